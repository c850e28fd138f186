"""Row changes made in a source table for the change data capture tests, counted by the
database's own row counts (not by the pipeline)."""

from __future__ import annotations

import random

KEYS = 120  # the keys the small transactions change, again and again
SNAPSHOT = 300  # rows in the table before capture starts (ids 0..SNAPSHOT-1)
END = -1  # the last row inserted: once its change is read, every change is


def create_tables(postgres, source: str, copy: str, rows: int = SNAPSHOT) -> None:
    """The source table with ``rows`` rows, and an empty copy of its shape."""
    with postgres.connect() as conn:
        for table in (source, copy):
            conn.execute(f"CREATE TABLE {table} (id int PRIMARY KEY, name text, score bigint)")
        conn.execute(
            f"INSERT INTO {source} SELECT g, 'n' || g, 0 FROM generate_series(0, %s::int) g",
            (rows - 1,),
        )


def read_both(postgres, source: str, copy: str) -> tuple[list, list]:
    """Both tables' rows, ordered by id."""
    with postgres.connect() as conn:
        want = conn.execute(f"SELECT id, name, score FROM {source} ORDER BY id").fetchall()
        got = conn.execute(f"SELECT id, name, score FROM {copy} ORDER BY id").fetchall()
    return want, got


class Workload:
    """Row changes made in the source table, counted by the database's row counts."""

    def __init__(self, postgres, table: str, rng: random.Random) -> None:
        self.postgres, self.table, self.rng = postgres, table, rng
        self.changed = 0
        self.live: set[int] = set(range(SNAPSHOT))

    def small(self, statements: int) -> None:
        """Inserts, updates and deletes of KEYS keys, 1-5 statements per transaction."""
        with self.postgres.connect() as conn:
            conn.autocommit = False
            left = statements
            while left > 0:
                with conn.transaction():
                    for _ in range(min(left, self.rng.randint(1, 5))):
                        self.changed += self._one(conn, self.rng.randrange(KEYS))
                        left -= 1

    def _one(self, conn, key: int) -> int:
        t = self.table
        if key not in self.live:
            self.live.add(key)
            cur = conn.execute(f"INSERT INTO {t} VALUES (%s, %s, %s)", (key, f"n{key}", 0))
        elif self.rng.random() < 0.3:
            self.live.discard(key)
            cur = conn.execute(f"DELETE FROM {t} WHERE id = %s", (key,))
        else:
            score = self.rng.randrange(10**6)
            cur = conn.execute(f"UPDATE {t} SET score = %s WHERE id = %s", (score, key))
        return cur.rowcount

    def large(self, rows: int) -> None:
        """One transaction: a block of new rows inserted, then every one of them updated."""
        with self.postgres.connect() as conn:
            conn.autocommit = False
            with conn.transaction():
                first = 10_000
                block = (first, first + rows - 1)
                cur = conn.execute(
                    f"INSERT INTO {self.table} SELECT g, 'big' || g, g "
                    "FROM generate_series(%s::int, %s::int) g",
                    block,
                )
                self.changed += cur.rowcount
                cur = conn.execute(
                    f"UPDATE {self.table} SET score = score + 1 WHERE id >= %s", (first,)
                )
                self.changed += cur.rowcount

    def end(self) -> None:
        with self.postgres.connect() as conn:
            cur = conn.execute(f"INSERT INTO {self.table} VALUES (%s, 'end', 0)", (END,))
            self.changed += cur.rowcount
