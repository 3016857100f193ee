"""AWS's error shapes for the JSON 1.1 protocol: ``{"__type": CODE, "message": TEXT}`` with
the HTTP status AWS uses for that code, so botocore raises the client's exception class of
that name (``client.exceptions.ResourceNotFoundException``) or a ``ClientError`` carrying it.
"""

from __future__ import annotations

import json

CONTENT_TYPE = "application/x-amz-json-1.1"

# The status AWS answers each code with; anything not listed is a client error (400).
STATUS = {
    "AccessDeniedException": 400,
    "IncompleteSignatureException": 400,
    "InternalException": 500,
    "InvalidSignatureException": 400,
    "MissingAuthenticationTokenException": 403,
    "RequestEntityTooLargeException": 413,
    "ServiceUnavailableException": 503,
    "UnrecognizedClientException": 400,
}


class ApiError(Exception):
    """A refused request: AWS's error code and one line saying what and where."""

    def __init__(self, code: str, message: str, status: int | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.message = message.splitlines()[0] if message else code
        self.status = status or STATUS.get(code, 400)


def validation(message: str) -> ApiError:
    return ApiError("ValidationException", message)


def not_found(message: str) -> ApiError:
    return ApiError("ResourceNotFoundException", message)


def error_parts(error: ApiError) -> tuple[int, bytes, list[tuple[bytes, bytes]]]:
    """The HTTP status, body and extra headers (ASGI's byte pairs) that answer ``error``."""
    body = json.dumps({"__type": error.code, "message": error.message}).encode()
    return error.status, body, [(b"x-amzn-errortype", error.code.encode("latin-1"))]


def catalog_error(exc: ValueError) -> ApiError:
    """A catalog refusal as AWS's code: missing things are ResourceNotFoundException, existing
    ones ResourceAlreadyExistsException, things in use ConcurrentModificationException,
    the rest ValidationException."""
    from eventpush.catalog import ConflictError, NotFoundError

    message = str(exc)
    if isinstance(exc, NotFoundError):
        return not_found(message)
    if isinstance(exc, ConflictError):
        if "already exists" in message:
            return ApiError("ResourceAlreadyExistsException", message)
        return ApiError("ConcurrentModificationException", message)
    return validation(message)
