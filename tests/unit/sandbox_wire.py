"""Stands in for a cloud sandbox SDK's HTTP transport in tests: records each request as the service would receive
it and answers from routes keyed by (method, host, path); a request no route expects is kept and fails the test.
"""

import email.parser
import email.policy
import json
from collections.abc import Callable
from dataclasses import dataclass

Answer = tuple[int, dict[str, str], bytes]  # status, headers, body


@dataclass
class Request:
    method: str
    host: str
    path: str
    query: dict[str, list[str]]
    headers: dict[str, str]  # names in lower case
    body: bytes

    def json(self):
        return json.loads(self.body)

    def multipart(self) -> list[tuple[str, str | None, bytes]]:
        """The (field name, filename, content) of each part of a multipart/form-data body, in order."""
        head = f"Content-Type: {self.headers['content-type']}\r\n\r\n".encode()
        message = email.parser.BytesParser(policy=email.policy.HTTP).parsebytes(head + self.body)
        return [(part.get_param("name", header="content-disposition"), part.get_filename(),
                 part.get_payload(decode=True)) for part in message.iter_parts()]


def json_answer(payload, status: int = 200) -> Answer:
    return status, {"content-type": "application/json"}, json.dumps(payload).encode()


def multipart_answer(parts: list[tuple[str, str, str, bytes]], boundary: str = "verst-test-boundary") -> Answer:
    """A multipart/form-data body of (field name, filename, content type, content) parts."""
    body = b"".join(f'--{boundary}\r\nContent-Disposition: form-data; name="{name}"; filename="{filename}"\r\n'
                    f"Content-Type: {content_type}\r\n\r\n".encode() + content + b"\r\n"
                    for name, filename, content_type, content in parts)
    return 200, {"content-type": f"multipart/form-data; boundary={boundary}"}, body + f"--{boundary}--\r\n".encode()


class Routes:
    def __init__(self):
        self.requests: list[Request] = []
        self.unexpected: list[str] = []
        self.table: dict[tuple[str, str, str], Callable[[Request], Answer]] = {}

    def on(self, method: str, host: str, path: str, answer: Callable[[Request], Answer]) -> None:
        self.table[(method, host, path)] = answer

    def answer(self, request: Request) -> Answer:
        self.requests.append(request)
        route = self.table.get((request.method, request.host, request.path))
        if route is None:
            self.unexpected.append(f"{request.method} {request.host}{request.path}")
            raise AssertionError(f"no route for {request.method} {request.host}{request.path}")
        return route(request)

    def sent(self, method: str, host: str, path: str) -> list[Request]:
        return [r for r in self.requests if (r.method, r.host, r.path) == (method, host, path)]
