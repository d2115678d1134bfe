"""The S3 stand-in's server: moto's S3 server, as ``moto_server -H HOST -p PORT`` runs it.

With ``S3_REFUSE_FLEXIBLE_CHECKSUMS=1`` it answers like an S3-compatible store that predates
the flexible checksums of newer AWS SDKs: a body sent ``aws-chunked`` with a trailing checksum
(``x-amz-content-sha256: STREAMING-...-TRAILER``, ``x-amz-trailer``) or any
``x-amz-checksum-*`` / ``x-amz-sdk-checksum-algorithm`` header (a GET's
``x-amz-checksum-mode`` is ignored, as such stores do) gets HTTP 400
``XAmzContentSHA256Mismatch``, and DeleteObjects needs ``Content-MD5``. The tests run the
stack's store this way (tests/docker) and on the host (tests/operators/storage).

    python3 s3-server.py HOST PORT
"""

from __future__ import annotations

import os
import sys

REFUSE_ENV = "S3_REFUSE_FLEXIBLE_CHECKSUMS"


def refusal(environ: dict) -> tuple[str, str] | None:
    """``(code, message)`` of the error an older store answers this WSGI request with, or None."""
    headers = {k[5:].replace("_", "-").lower(): v for k, v in environ.items()
               if k.startswith("HTTP_")}
    if "content-encoding" not in headers and environ.get("CONTENT_ENCODING"):
        headers["content-encoding"] = environ["CONTENT_ENCODING"]
    sha = headers.get("x-amz-content-sha256", "")
    new = [name for name in headers  # x-amz-checksum-mode (a GET asking for one) is ignored
           if name.startswith("x-amz-checksum-") and name != "x-amz-checksum-mode"
           or name in ("x-amz-sdk-checksum-algorithm", "x-amz-trailer")]
    if sha.endswith("-TRAILER") or "aws-chunked" in headers.get("content-encoding", "") or new:
        return ("XAmzContentSHA256Mismatch",
                "The provided 'x-amz-content-sha256' header does not match what was computed "
                f"(this store does not support flexible checksums: {', '.join(new) or sha})")
    if (environ.get("REQUEST_METHOD") == "POST" and "delete" in environ.get("QUERY_STRING", "")
            and "content-md5" not in headers and not environ.get("CONTENT_MD5")):
        return "InvalidRequest", "Missing required header for this request: Content-Md5"
    return None


def strict(app):
    """``app`` (WSGI) behind :func:`refusal`."""

    def wrapped(environ, start_response):
        refused = refusal(environ)
        if refused is None:
            return app(environ, start_response)
        length = int(environ.get("CONTENT_LENGTH") or 0)
        if length:
            environ["wsgi.input"].read(length)  # drain: keep the connection usable
        body = ('<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>{}</Code><Message>{}'
                "</Message></Error>").format(*refused).encode()
        start_response("400 Bad Request", [("Content-Type", "application/xml"),
                                           ("Content-Length", str(len(body)))])
        return [body]

    return wrapped


def main(argv: list[str]) -> None:
    from moto.moto_server.werkzeug_app import (DomainDispatcherApplication, MotoRequestHandler,
                                               create_backend_app)
    from werkzeug.serving import run_simple

    host, port = argv[0], int(argv[1])
    os.environ.setdefault("MOTO_PORT", str(port))
    app = DomainDispatcherApplication(create_backend_app)
    if os.environ.get(REFUSE_ENV) == "1":
        app = strict(app)
        print(f"refusing flexible checksums ({REFUSE_ENV}=1)", flush=True)
    run_simple(host, port, app, threaded=True, request_handler=MotoRequestHandler)


if __name__ == "__main__":
    main(sys.argv[1:])
