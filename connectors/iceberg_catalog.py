"""The Iceberg sink's catalog: opened once per process, tables created, errors without secrets.

Catalog properties go to ``pyiceberg.catalog.load_catalog`` as they are and are never printed
(they may hold credentials): an error is said in one line, with their values masked.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from typing import Any

from onceflow.connectors.errors import ConnectorError

_SECRET = re.compile(r"(://[^:/@\s]+:)[^@\s]+@")
_CATALOGS: dict[str, Any] = {}  # one per process and configuration (opening one costs queries)


def open_catalog(name: str, properties: dict[str, str], what: str) -> Any:
    """The pyiceberg catalog ``name`` of ``properties`` (one per process and configuration)."""
    try:
        from pyiceberg.catalog import load_catalog
    except ImportError as exc:
        msg = "IcebergSink needs pyiceberg: pip install 'onceflow[iceberg]'"
        raise ConnectorError(msg) from exc
    key = json.dumps([name, sorted(properties.items())])
    if key not in _CATALOGS:
        try:
            _CATALOGS[key] = load_catalog(name, **properties)
        except Exception as exc:  # noqa: BLE001 - any catalog's errors, said in one line
            msg = f"cannot open the Iceberg catalog of {what}: {secret_free(exc, properties)}"
            raise ConnectorError(msg) from None
    return _CATALOGS[key]


def secret_free(exc: BaseException, properties: dict[str, str]) -> str:
    """An error's first line without the catalog's property values or URL passwords."""
    text = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
    for value in properties.values():
        if len(value) >= 4:
            text = text.replace(value, "***")
    return _SECRET.sub(r"\1***@", text)


def create_table(catalog: Any, table: str, schema: Any, partition_by: Sequence[str]) -> None:
    """Create ``table`` (and its namespace) unless another writer was first: its schema it is."""
    from pyiceberg.exceptions import CommitFailedException, TableAlreadyExistsError

    try:
        _ensure_namespace(catalog, table.rsplit(".", 1)[0])
        tx = catalog.create_table_transaction(table, schema=schema)
        if partition_by:
            with tx.update_spec() as spec:
                for column in partition_by:
                    spec.add_identity(column)
        tx.commit_transaction()
    except (TableAlreadyExistsError, CommitFailedException):
        pass


def _ensure_namespace(catalog: Any, namespace: str) -> None:
    """Create the namespace unless it exists; two tasks may race to create it.

    A SQL catalog's loser fails on the unique key (``IntegrityError``, not pyiceberg's
    ``NamespaceAlreadyExistsError``): the namespace is there, which is all that was asked.
    """
    try:
        catalog.create_namespace_if_not_exists(namespace)
    except Exception:
        if not catalog.namespace_exists(namespace):
            raise
