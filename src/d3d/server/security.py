"""The Guard middleware of d3d serve: Host, API key, origin and content-type checks before any endpoint runs."""
from __future__ import annotations

import hmac
import ipaddress
from base64 import b64decode

from fastapi.responses import Response
from starlette.datastructures import Headers

from ..errors import D3DError
from .metrics import Metrics
from .requests import API_PATHS, ApiError


LOOPBACK_NAMES = ("localhost", "127.0.0.1", "[::1]")


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return host == "localhost"


def _is_wildcard(host: str) -> bool:
    return host in ("", "0.0.0.0", "::", "[::]")


def host_name(host: str) -> str:
    """A Host header's or --host's name without port, brackets, trailing dot or case: "[::1]:8000" -> "::1"."""
    host = host.strip().lower()
    if host.startswith("["):
        host = host[1:].partition("]")[0]
    elif host.count(":") == 1:
        host = host.partition(":")[0]
    return host.rstrip(".")


def _is_ip(name: str) -> bool:
    try:
        ipaddress.ip_address(name)
        return True
    except ValueError:
        return False


def check_api_key(key: str | None) -> str | None:
    """The API key as compared: surrounding whitespace stripped (a presented key is stripped the same
    way); None for no key. An empty or whitespace-only key is refused (it would mean no authentication)."""
    if key is None:
        return None
    if not isinstance(key, str) or not key.strip():
        raise D3DError("--api-key (or $D3D_API_KEY) is empty or whitespace only; give a real key, or leave it "
                       "unset to serve without one")
    return key.strip()


class Guard:
    """ASGI middleware that refuses, before any endpoint runs: a Host header that names none of this
    server's names (421, on every path: DNS rebinding), a missing or wrong API key (401), a browser
    request from another origin (403; preflights from --allow-origin origins get CORS headers), a POST
    that is not application/json (415)."""

    def __init__(self, app, metrics: Metrics, api_key: str | None, allow_origins: list[str], bind_host: str,
                 allow_hosts: list[str] | tuple = ()):
        self.app, self.metrics, self.api_key = app, metrics, check_api_key(api_key)
        self.allow_origins, self.bind_host = set(allow_origins), bind_host
        self.any_host = "*" in allow_hosts
        self.hosts = {host_name(h) for h in (*LOOPBACK_NAMES, *allow_hosts) if h != "*"}
        if not _is_wildcard(bind_host):
            self.hosts.add(host_name(bind_host))

    def host_allowed(self, headers: Headers) -> bool:
        """The Host header names this server: a loopback name, the --host address, an --allow-host name,
        or (listening on every interface) any IP address; no Host header (HTTP/1.0) passes. A DNS-rebound
        name (an attacker's domain now resolving to this machine) is none of these."""
        host = headers.get("host")
        if host is None or self.any_host:
            return True
        name = host_name(host)
        return name in self.hosts or (_is_wildcard(self.bind_host) and _is_ip(name))

    def own_origins(self, scope, headers: Headers) -> set[str]:
        """The origins the built-in page has when loaded from this server: its own host names at its port,
        or (when listening on every interface) the Host the browser used."""
        if _is_wildcard(self.bind_host):
            return {f"http://{headers.get('host', '')}"}
        port = (scope.get("server") or ("", 80))[1]
        host = f"[{self.bind_host}]" if ":" in self.bind_host else self.bind_host
        names = {host} | (set(LOOPBACK_NAMES) if _is_loopback(self.bind_host) else set())
        return {f"http://{n}:{port}" for n in names} | ({f"http://{n}" for n in names} if port == 80 else set())

    def allowed(self, origin: str) -> bool:
        return "*" in self.allow_origins or origin in self.allow_origins

    def authorized(self, headers: Headers) -> bool:
        scheme, _, cred = headers.get("authorization", "").partition(" ")
        if scheme.lower() == "basic":
            try:
                cred = b64decode(cred, validate=True).decode().partition(":")[2]
            except ValueError:
                return False
        elif scheme.lower() != "bearer":
            return False
        return hmac.compare_digest(cred.strip().encode(), self.api_key.encode())  # both stripped (check_api_key)

    def check(self, scope, headers: Headers) -> ApiError | None:
        path, method = scope["path"], scope["method"]
        origin = headers.get("origin")
        if origin is not None and origin not in self.own_origins(scope, headers) and not self.allowed(origin):
            return ApiError(403, f"cross-origin request from {origin} refused (see --allow-origin)",
                            code="origin_not_allowed", type_="permission_error")
        if self.api_key and path != "/health" and not self.authorized(headers):
            challenge = 'Basic realm="d3d"' if path == "/" else "Bearer"
            return ApiError(401, "missing or invalid API key: send 'Authorization: Bearer KEY'",
                            code="invalid_api_key", type_="authentication_error",
                            headers={"WWW-Authenticate": challenge})
        if method == "POST":
            kind = headers.get("content-type", "").split(";")[0].strip().lower()
            if kind != "application/json":
                return ApiError(415, f"Content-Type must be application/json (got {kind or 'none'})",
                                code="unsupported_media_type")
        return None

    def preflight(self, origin: str) -> Response:
        return Response(status_code=204, headers={
            "Access-Control-Allow-Origin": origin, "Access-Control-Allow-Methods": "GET, POST",
            "Access-Control-Allow-Headers": "Authorization, Content-Type", "Access-Control-Max-Age": "600",
            "Vary": "Origin"})

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = Headers(scope=scope)
        if not self.host_allowed(headers):
            if scope["path"] in API_PATHS:
                self.metrics.request(scope["path"], 421)
            err = ApiError(421, f"Host {headers.get('host', '')[:100]!r} is not a name of this server (see "
                                "--allow-host)", code="host_not_allowed", type_="permission_error")
            return await err.response()(scope, receive, send)
        origin = headers.get("origin")
        cors = origin is not None and self.allowed(origin)
        if scope["method"] == "OPTIONS" and cors:
            return await self.preflight(origin)(scope, receive, send)
        err = self.check(scope, headers)
        if err is not None:
            if scope["path"] in API_PATHS:
                self.metrics.request(scope["path"], err.status)
            return await err.response()(scope, receive, send)
        if not cors:
            return await self.app(scope, receive, send)

        async def send_cors(message):
            if message["type"] == "http.response.start":
                message = message | {"headers": list(message.get("headers", [])) + [
                    (b"access-control-allow-origin", origin.encode()), (b"vary", b"Origin")]}
            await send(message)

        await self.app(scope, receive, send_cors)


# ---------------------------------------------------------------------------------------------
# The app
