"""A small client of the Confluent Schema Registry REST API (and of what speaks it).

Confluent Schema Registry, Karapace, Redpanda and Apicurio (at ``/apis/ccompat/v7``) answer
the same few calls this client makes: a schema by id, the id of a schema under a subject
(looked up, or registered). Answers are cached per process (:data:`_BY_ID`, :data:`_IDS`):
ids are immutable in a registry, so a worker asks once per schema id it meets and the hot
path makes no HTTP call per record.

Errors: what the registry says about the data (an unknown schema id) is a
:class:`~onceflow.kernel.errors.CodecError`, which the Kafka source turns into a dead letter;
a registry that cannot be reached (or answers 5xx) is a
:class:`~onceflow.kernel.errors.ServiceError`, which fails the task (it is retried), never a
dead letter: records must not be written off because the registry was down for a moment.
A schema the registry refuses (incompatible with the subject's versions) is a
:class:`~onceflow.kernel.errors.ConfigError`, raised on the driver before the run.

Credentials: ``username``/``password`` (HTTP basic auth), or ``http://user:password@host``;
they are sent in the ``Authorization`` header and never printed (``repr`` and messages show
the URL without them).
"""

from __future__ import annotations

import base64
import json
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from typing import Any

from onceflow.kernel.errors import CodecError, ConfigError, ServiceError

CONTENT_TYPE = "application/vnd.schemaregistry.v1+json"
TIMEOUT_S = 10.0
ATTEMPTS = 3
BACKOFF_S = 0.5
NOT_FOUND = 404
CONFLICT = 409
UNPROCESSABLE = 422
SERVER_ERROR = 500

# Per process: (registry url, schema id) -> (schema type, schema text); ids never change.
_BY_ID: dict[tuple[str, int], tuple[str, str]] = {}
# Per process: (registry url, subject, schema type, schema text) -> schema id.
_IDS: dict[tuple[str, str, str, str], int] = {}
_LOCK = threading.Lock()


class SchemaRegistry:
    """Where the registry is and how to log in; picklable (it holds strings only).

    ``url`` is the API's base (``http://host:8081``, or Apicurio's
    ``http://host:8080/apis/ccompat/v7``); user info in it (``http://user:pw@host``) is
    taken as ``username``/``password``.
    """

    def __init__(
        self,
        url: str,
        *,
        username: str | None = None,
        password: str | None = None,
        timeout: float = TIMEOUT_S,
    ) -> None:
        parts = urllib.parse.urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            msg = (
                f"a schema registry URL must be http(s)://host[:port][/path], got {parts.scheme!r}"
            )
            raise ConfigError(msg)
        if parts.username is not None and username is None:
            username = urllib.parse.unquote(parts.username)
            password = urllib.parse.unquote(parts.password or "")
        netloc = parts.hostname + (f":{parts.port}" if parts.port else "")
        self.url = urllib.parse.urlunsplit((parts.scheme, netloc, parts.path.rstrip("/"), "", ""))
        self._auth: str | None = None
        if username is not None:
            token = base64.b64encode(f"{username}:{password or ''}".encode()).decode("ascii")
            self._auth = f"Basic {token}"
        self.timeout = timeout

    def __repr__(self) -> str:
        login = ", with basic auth" if self._auth else ""
        return f"SchemaRegistry({self.url!r}{login})"

    def schema_by_id(self, schema_id: int) -> tuple[str, str]:
        """``(schema type, schema text)`` of ``schema_id``; CodecError if the registry has none."""
        key = (self.url, schema_id)
        found = _BY_ID.get(key)
        if found is not None:
            return found
        status, body = self._call("GET", f"/schemas/ids/{schema_id}")
        if status == NOT_FOUND:
            msg = f"schema id {schema_id} is not in the schema registry at {self.url}"
            raise CodecError(msg)
        self._check(status, body, f"reading schema id {schema_id}")
        found = (str(body.get("schemaType") or "AVRO").upper(), str(body["schema"]))
        with _LOCK:
            _BY_ID[key] = found
        return found

    def lookup(self, subject: str, schema: str, schema_type: str) -> int | None:
        """The id of ``schema`` under ``subject``, or None if it is not registered there."""
        key = (self.url, subject, schema_type, schema)
        if key in _IDS:
            return _IDS[key]
        path = f"/subjects/{urllib.parse.quote(subject, safe='')}"
        status, body = self._call("POST", path, _payload(schema, schema_type))
        if status == NOT_FOUND:
            return None
        self._check(status, body, f"looking up the schema of subject {subject!r}")
        return self._remember(key, int(body["id"]))

    def register(self, subject: str, schema: str, schema_type: str) -> int:
        """Register ``schema`` under ``subject`` (a no-op if it is there); its id."""
        key = (self.url, subject, schema_type, schema)
        if key in _IDS:
            return _IDS[key]
        path = f"/subjects/{urllib.parse.quote(subject, safe='')}/versions"
        status, body = self._call("POST", path, _payload(schema, schema_type))
        if status in (CONFLICT, UNPROCESSABLE):
            msg = (
                f"the schema registry at {self.url} refused the schema for subject {subject!r}: "
                f"{body.get('message', body)}; make the schema compatible with the subject's "
                "versions or change the subject's compatibility setting"
            )
            raise ConfigError(msg)
        self._check(status, body, f"registering a schema under subject {subject!r}")
        return self._remember(key, int(body["id"]))

    def _remember(self, key: tuple[str, str, str, str], schema_id: int) -> int:
        with _LOCK:
            _IDS[key] = schema_id
        return schema_id

    def _check(self, status: int, body: dict[str, Any], doing: str) -> None:
        if status >= SERVER_ERROR:
            msg = f"the schema registry at {self.url} failed {doing}: HTTP {status} {body}"
            raise ServiceError(msg)
        if status >= 400:  # noqa: PLR2004 - HTTP client errors
            msg = f"the schema registry at {self.url} refused {doing}: HTTP {status} {body}"
            raise ConfigError(msg)

    def _call(
        self, method: str, path: str, payload: bytes | None = None
    ) -> tuple[int, dict[str, Any]]:
        """``(status, JSON body)``; retried a few times, then ServiceError if unreachable."""
        headers = {"Accept": CONTENT_TYPE, "Content-Type": CONTENT_TYPE}
        if self._auth:
            headers["Authorization"] = self._auth
        failure: Exception | None = None
        for attempt in range(ATTEMPTS):
            request = urllib.request.Request(
                self.url + path, data=payload, headers=headers, method=method
            )
            try:
                with urllib.request.urlopen(request, timeout=self.timeout) as answer:
                    return answer.status, _json(answer.read())
            except urllib.error.HTTPError as exc:
                if exc.code < SERVER_ERROR:
                    return exc.code, _json(exc.read())
                failure = exc
            except (urllib.error.URLError, OSError) as exc:
                failure = exc
            if attempt + 1 < ATTEMPTS:
                time.sleep(BACKOFF_S * (attempt + 1))
        msg = (
            f"the schema registry at {self.url} could not be reached ({method} {path}): "
            f"{failure}; check that it runs and that the URL is right"
        )
        raise ServiceError(msg)


def _payload(schema: str, schema_type: str) -> bytes:
    body: dict[str, Any] = {"schema": schema}
    if schema_type != "AVRO":  # the API's default; older registries reject the field
        body["schemaType"] = schema_type
    return json.dumps(body).encode()


def _json(raw: bytes) -> dict[str, Any]:
    try:
        found = json.loads(raw or b"{}")
    except ValueError:
        return {"message": raw[:200].decode("utf-8", "replace")}
    return found if isinstance(found, dict) else {"answer": found}


def as_registry(registry: str | SchemaRegistry, **login: Any) -> SchemaRegistry:
    """A :class:`SchemaRegistry` from a URL (with ``username``/``password``) or as given."""
    if isinstance(registry, SchemaRegistry):
        return registry
    return SchemaRegistry(registry, **login)
