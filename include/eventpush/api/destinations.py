"""Connections and API destinations: ``CreateConnection``, ``DescribeConnection``,
``ListConnections``, ``UpdateConnection``, ``DeleteConnection`` and the same five for
``ApiDestination``, onto the catalog's functions (the CLI's ``connection`` and
``destination``).

- ``AuthorizationType`` ``API_KEY``, ``BASIC``, ``OAUTH_CLIENT_CREDENTIALS`` are our
  ``api-key``, ``basic``, ``oauth-client-credentials``; the OAuth2 ``BodyParameters`` are the
  extra token request fields (a ``scope`` among them becomes the scopes); the token request
  is always a POST with the client in HTTP Basic, so ``HttpMethod`` must be ``POST`` and
  ``OAuthHttpParameters`` header and query parameters are refused.
- ``InvocationHttpParameters``: header and query parameters, never secret here (a secret
  belongs in ``AuthParameters``, where it is sealed): ``IsValueSecret`` true is refused, as
  are ``BodyParameters``.
- Secrets are never answered: ``DescribeConnection`` gives the key's name, the user name and
  the client id only, as AWS does.
- An API destination's ``ConnectionArn`` is optional here (a destination may send without
  one); ``InvocationRateLimitPerSecond`` is its rate limit.
"""

from __future__ import annotations

from eventpush import catalog
from eventpush.api.errors import validation
from eventpush.api.service import Call
from eventpush.api.shapes import (
    check_owner,
    checked,
    described,
    optional,
    page,
    required,
    timestamp,
)

AUTH_TYPES = {
    "API_KEY": "api-key",
    "BASIC": "basic",
    "OAUTH_CLIENT_CREDENTIALS": "oauth-client-credentials",
}
AWS_TYPES = {ours: theirs for theirs, ours in AUTH_TYPES.items()}


def arn(call: Call, kind: str, name: str) -> str:
    return f"arn:aws:events:{call.settings.region}:{call.settings.account}:{kind}/{name}"


def name_of_arn(value: str, kind: str, account: str, region: str) -> str:
    """A connection's or destination's name from its ARN (or the name itself); an ARN of
    another account or region is refused, not taken as ours of that name."""
    if value.startswith("arn:"):
        head, sep, rest = value.partition(f":{kind}/")
        parts = head.split(":")
        if not sep or not rest or len(parts) != 5:
            raise validation(f"{value[:200]!r} is not a {kind} ARN")
        name = rest.split("/", 1)[0]
        check_owner((parts[4], parts[3]), account, region, f"{kind} {name}")
        return name
    return value


def _name(call: Call, value: str, kind: str) -> str:
    return name_of_arn(value, kind, call.settings.account, call.settings.region)


def _parameters(params: dict | None, where: str) -> tuple[list, list]:
    """(headers, query) of an ``HttpParameters`` structure; body parameters refused."""
    params = checked(params or {}, where, dict)
    if params.get("BodyParameters"):
        raise validation(f"{where}.BodyParameters is not supported by eventpush")
    out = []
    for member in ("HeaderParameters", "QueryStringParameters"):
        pairs = []
        for item in checked(params.get(member) or [], member, list):
            item = checked(item, member, dict)
            if item.get("IsValueSecret"):
                raise validation(
                    f"{where}.{member}: IsValueSecret is not supported: put the secret in "
                    "AuthParameters, where it is sealed"
                )
            pairs.append((required(item, "Key"), required(item, "Value")))
        out.append(pairs)
    return out[0], out[1]


def _auth(kind: str, auth: dict) -> tuple[str | None, dict]:
    """(secret, catalog fields) of ``AuthParameters`` for an authorization type."""
    if kind == "api-key":
        given = checked(required(auth, "ApiKeyAuthParameters", dict), "ApiKeyAuthParameters", dict)
        return optional(given, "ApiKeyValue"), {"key_name": optional(given, "ApiKeyName")}
    if kind == "basic":
        given = checked(required(auth, "BasicAuthParameters", dict), "BasicAuthParameters", dict)
        return optional(given, "Password"), {"username": optional(given, "Username")}
    given = required(auth, "OAuthParameters", dict)
    client = checked(given.get("ClientParameters") or {}, "ClientParameters", dict)
    method = optional(given, "HttpMethod", str, "POST")
    if method != "POST":
        raise validation("OAuthParameters.HttpMethod must be POST: the token request is a POST")
    http = checked(given.get("OAuthHttpParameters") or {}, "OAuthHttpParameters", dict)
    if http.get("HeaderParameters") or http.get("QueryStringParameters"):
        raise validation(
            "OAuthHttpParameters: only BodyParameters (token request fields) are supported"
        )
    body = []
    for item in checked(http.get("BodyParameters") or [], "BodyParameters", list):
        item = checked(item, "BodyParameters", dict)
        if item.get("IsValueSecret"):
            # Kept unsealed and answered by DescribeConnection: a secret would leak.
            raise validation(
                "OAuthHttpParameters.BodyParameters: IsValueSecret is not supported: the "
                "client secret goes in ClientParameters, where it is sealed"
            )
        body.append((required(item, "Key"), required(item, "Value")))
    scopes = [v for k, v in body if k == "scope"]
    fields = {
        "token_url": optional(given, "AuthorizationEndpoint"),
        "client_id": optional(client, "ClientID"),
        "scopes": [s for scope in scopes for s in scope.split()],
        "oauth_params": [(k, v) for k, v in body if k != "scope"],
    }
    return optional(client, "ClientSecret"), fields


def connection_shape(call: Call, info) -> dict:
    return {
        "ConnectionArn": arn(call, "connection", info.name),
        "Name": info.name,
        "ConnectionState": "AUTHORIZED",
        "AuthorizationType": AWS_TYPES[info.auth],
        "CreationTime": timestamp(info.created_at),
        "LastModifiedTime": timestamp(info.updated_at),
    }


def _described_auth(info) -> dict:
    if info.auth == "api-key":
        return {"ApiKeyAuthParameters": {"ApiKeyName": info.key_name}}
    if info.auth == "basic":
        return {"BasicAuthParameters": {"Username": info.username}}
    body = [{"Key": k, "Value": v, "IsValueSecret": False} for k, v in info.oauth_params]
    if info.scopes:
        body.append({"Key": "scope", "Value": " ".join(info.scopes), "IsValueSecret": False})
    return {
        "OAuthParameters": {
            "ClientParameters": {"ClientID": info.client_id},
            "AuthorizationEndpoint": info.token_url,
            "HttpMethod": "POST",
            "OAuthHttpParameters": {"BodyParameters": body},
        }
    }


def _invocation_shape(info) -> dict:
    def items(pairs):
        return [{"Key": k, "Value": v, "IsValueSecret": False} for k, v in pairs]

    return {
        "HeaderParameters": items(info.headers),
        "QueryStringParameters": items(info.query),
    }


async def create_connection(call: Call, body: dict) -> dict:
    name = required(body, "Name")
    kind = AUTH_TYPES.get(required(body, "AuthorizationType"))
    if kind is None:
        raise validation(f"AuthorizationType must be one of {', '.join(AUTH_TYPES)}")
    secret, fields = _auth(kind, required(body, "AuthParameters", dict))
    auth = checked(body["AuthParameters"], "AuthParameters", dict)
    headers, query = _parameters(auth.get("InvocationHttpParameters"), "InvocationHttpParameters")
    info = await call.db(
        catalog.create_connection,
        name,
        kind,
        secret,
        headers=headers,
        query=query,
        description=optional(body, "Description", str, ""),
        **{k: v for k, v in fields.items() if v not in (None, [])},
    )
    shape = connection_shape(call, info)
    return {k: shape[k] for k in ("ConnectionArn", "ConnectionState", "CreationTime")} | {
        "LastModifiedTime": shape["LastModifiedTime"]
    }


async def describe_connection(call: Call, body: dict) -> dict:
    info = await call.db(catalog.get_connection, _name(call, required(body, "Name"), "connection"))
    return (
        connection_shape(call, info)
        | described(info.description)
        | {
            "AuthParameters": _described_auth(info)
            | {"InvocationHttpParameters": _invocation_shape(info)},
        }
    )


def listed(call: Call, body: dict, infos: list, member: str, shape) -> dict:
    """One page of ``infos`` whose name starts with ``NamePrefix``, as ``member``."""
    prefix = optional(body, "NamePrefix", str, "")
    infos = [info for info in infos if info.name.startswith(prefix)]
    chunk, token = page(infos, body, key=lambda info: info.name, scope=member)
    answer: dict = {member: [shape(call, info) for info in chunk]}
    if token:
        answer["NextToken"] = token
    return answer


async def list_connections(call: Call, body: dict) -> dict:
    infos = await call.db(catalog.list_connections)
    return listed(call, body, infos, "Connections", connection_shape)


async def update_connection(call: Call, body: dict) -> dict:
    name = required(body, "Name")
    changes: dict = {}
    if body.get("Description") is not None:
        changes["description"] = optional(body, "Description")
    kind = None
    if body.get("AuthorizationType") is not None:
        kind = AUTH_TYPES.get(optional(body, "AuthorizationType"))
        if kind is None:
            raise validation(f"AuthorizationType must be one of {', '.join(AUTH_TYPES)}")
        changes["auth"] = kind
    auth = optional(body, "AuthParameters", dict)
    if auth:
        if kind is None:
            kind = (await call.db(catalog.get_connection, name)).auth
        if any(auth.get(m) for m in ("ApiKeyAuthParameters", "BasicAuthParameters",
                                      "OAuthParameters")):  # fmt: skip
            secret, fields = _auth(kind, auth)
            changes.update({k: v for k, v in fields.items() if v not in (None, [])})
            if secret is not None:
                changes["secret"] = secret
        if auth.get("InvocationHttpParameters") is not None:
            headers, query = _parameters(
                auth["InvocationHttpParameters"], "InvocationHttpParameters"
            )
            changes.update(headers=headers, query=query)
    info = await call.db(catalog.update_connection, name, **changes)
    shape = connection_shape(call, info)
    return {k: shape[k] for k in ("ConnectionArn", "ConnectionState", "LastModifiedTime")}


async def delete_connection(call: Call, body: dict) -> dict:
    name = _name(call, required(body, "Name"), "connection")
    info = await call.db(catalog.get_connection, name)
    await call.db(catalog.delete_connection, name)
    shape = connection_shape(call, info)
    return {"ConnectionArn": shape["ConnectionArn"], "ConnectionState": "DELETING"}


# --- API destinations -------------------------------------------------------------------------


def destination_shape(call: Call, info) -> dict:
    shape = {
        "ApiDestinationArn": arn(call, "api-destination", info.name),
        "Name": info.name,
        "ApiDestinationState": "ACTIVE",
        "InvocationEndpoint": info.url,
        "HttpMethod": info.method,
        "CreationTime": timestamp(info.created_at),
        "LastModifiedTime": timestamp(info.updated_at),
    }
    if info.connection is not None:
        shape["ConnectionArn"] = arn(call, "connection", info.connection)
    if info.rate_limit is not None:
        shape["InvocationRateLimitPerSecond"] = int(info.rate_limit)
    return shape


def _destination_fields(call: Call, body: dict, create: bool) -> dict:
    fields: dict = {}
    if create or body.get("InvocationEndpoint") is not None:
        fields["url"] = required(body, "InvocationEndpoint")
    if create or body.get("HttpMethod") is not None:
        fields["method"] = required(body, "HttpMethod")
    if body.get("ConnectionArn") is not None:
        fields["connection"] = _name(call, optional(body, "ConnectionArn"), "connection")
    if body.get("InvocationRateLimitPerSecond") is not None:
        fields["rate_limit"] = checked(
            body["InvocationRateLimitPerSecond"], "InvocationRateLimitPerSecond", int
        )
    if body.get("Description") is not None:
        fields["description"] = optional(body, "Description")
    return fields


async def create_api_destination(call: Call, body: dict) -> dict:
    name = required(body, "Name")
    fields = _destination_fields(call, body, create=True)
    info = await call.db(catalog.create_destination, name, fields.pop("url"), **fields)
    shape = destination_shape(call, info)
    keys = ("ApiDestinationArn", "ApiDestinationState", "CreationTime", "LastModifiedTime")
    return {k: shape[k] for k in keys}


async def describe_api_destination(call: Call, body: dict) -> dict:
    name = _name(call, required(body, "Name"), "api-destination")
    info = await call.db(catalog.get_destination, name)
    return destination_shape(call, info) | described(info.description)


async def list_api_destinations(call: Call, body: dict) -> dict:
    connection = optional(body, "ConnectionArn", str, None)
    wanted = None if connection is None else _name(call, connection, "connection")
    infos = [
        i
        for i in await call.db(catalog.list_destinations)
        if wanted is None or i.connection == wanted
    ]
    return listed(call, body, infos, "ApiDestinations", destination_shape)


async def update_api_destination(call: Call, body: dict) -> dict:
    name = required(body, "Name")
    info = await call.db(catalog.update_destination, name, **_destination_fields(call, body, False))
    shape = destination_shape(call, info)
    return {k: shape[k] for k in ("ApiDestinationArn", "ApiDestinationState", "LastModifiedTime")}


async def delete_api_destination(call: Call, body: dict) -> dict:
    name = _name(call, required(body, "Name"), "api-destination")
    await call.db(catalog.delete_destination, name)
    return {}


OPERATIONS = {
    "CreateConnection": create_connection,
    "DescribeConnection": describe_connection,
    "ListConnections": list_connections,
    "UpdateConnection": update_connection,
    "DeleteConnection": delete_connection,
    "CreateApiDestination": create_api_destination,
    "DescribeApiDestination": describe_api_destination,
    "ListApiDestinations": list_api_destinations,
    "UpdateApiDestination": update_api_destination,
    "DeleteApiDestination": delete_api_destination,
}
