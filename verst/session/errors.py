"""The one error the session layer raises toward its callers: an HTTP status and a message naming the
offending field and value (the HTTP adapter sends both; in-process callers read `status`)."""

from __future__ import annotations


class SessionError(Exception):
    """404 unknown session, 400 bad request or diverged history, 502 engine unreachable or its reply unusable."""

    def __init__(self, status: int, message: str, field: str | None = None):
        super().__init__(message)
        self.status, self.message, self.field = status, message, field

    def to_openai(self) -> dict:
        """OpenAI's error body, which the official client turns into its exception's message."""
        kind = {400: "invalid_request_error", 404: "not_found_error", 502: "engine_error"}.get(self.status, "error")
        return {"error": {"message": self.message, "type": kind, "param": self.field, "code": self.status}}
