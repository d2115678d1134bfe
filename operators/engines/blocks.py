"""Checks that the engines' spec blocks (``training.<engine>``) share: environment variable
names, credentials kept out of the spec, DNS names.

Each block is a :class:`~trainforge.sections.SpecModel` in its engine's ``spec`` module.
"""

from __future__ import annotations

import re
from typing import Any

from trainforge.sections import check_length, field_errors

# RFC 1123 label (namespaces, queue names, secret names, priority classes).
DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$")
# RFC 1123 subdomain (ConfigMap and Secret names may contain dots).
DNS_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?$")
ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
# Environment every rank gets from the engine and the train task (docs/contracts.md).
ENGINE_ENV = frozenset({"OMP_NUM_THREADS", "PYTHONUNBUFFERED", "TRAINFORGE_RESULT_FILE",
                         "MLFLOW_TRACKING_URI", "MLFLOW_RUN_ID"})


# Names of variables that hold credentials. The spec is committed and rendered verbatim into
# job requests, so credentials never come from it (docs/storage.md, "Credentials and endpoint").
_CREDENTIAL_NAMES = frozenset({"AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN"})
_CREDENTIAL_WORDS = frozenset({"PASSWORD", "PASSWD", "PASSPHRASE", "SECRET", "TOKEN",
                               "CREDENTIAL", "CREDENTIALS", "APIKEY"})


def is_credential_name(name: str) -> bool:
    """Whether an environment variable named ``name`` carries a credential: the AWS key
    variables, a ``_``-separated word such as PASSWORD, SECRET or TOKEN (``HF_TOKEN``, not
    ``TOKENIZERS_PARALLELISM``), or a name ending in ``_KEY`` or ``_KEY_ID`` (``WANDB_API_KEY``)."""
    upper = name.upper()
    words = upper.split("_")
    return (upper in _CREDENTIAL_NAMES or any(w in _CREDENTIAL_WORDS for w in words)
            or words[-1] == "KEY" or upper.endswith("_KEY_ID"))


#: A Linux network interface name: 1-15 characters, no '/', ':' or whitespace.
IFNAME = re.compile(r"^(?!\.{1,2}$)[^\s/:,]{1,15}$")


def check_socket_ifname(name: str, value: str) -> None:
    """``GLOO_SOCKET_IFNAME`` (interface names, comma-separated) or ``NCCL_SOCKET_IFNAME``
    (NCCL's syntax: an optional ``^`` to exclude, ``=`` for exact names, then comma-separated
    prefixes); ValueError saying what the backend accepts."""
    items = value.split(",")
    if name == "NCCL_SOCKET_IFNAME":
        rest = value[1:] if value.startswith("^") else value
        rest = rest[1:] if rest.startswith("=") else rest
        if not all(IFNAME.match(item) and item[0] not in "^=" for item in rest.split(",")):
            raise ValueError(f"{name} must be NCCL's interface list: an optional '^' (exclude) "
                             f"and '=' (exact names), then interface names or prefixes separated "
                             f"by ',' (got {value!r}; e.g. 'eth', '^docker0,lo' or '=ib0')")
    elif not all(IFNAME.match(item) and item[0] not in "^=" for item in items):
        nccl = (" ('^' and '=' are NCCL's syntax, which Gloo does not read)"
                if value[:1] and value[0] in "^=" else "")
        raise ValueError(f"{name} must be the names of network interfaces separated by ',', as "
                         f"Gloo opens each one (got {value!r}; e.g. 'eth0' or 'eth0,eth1'){nccl}")


def socket_interfaces_checked(block: Any) -> Any:
    """``block`` (an engine block with ``env_vars``) when every socket-interface value in it is
    one the backend can read; otherwise a `ValidationError` with each bad one at its own
    variable, all at once (the blocks' ``model_validator(mode="after")``)."""
    errors, env = [], block.env_vars
    for name in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"):
        if name in env:
            try:
                check_socket_ifname(name, env[name])
            except ValueError as err:
                errors.append((("env_vars", name), str(err), env[name], ("env_vars",)))
    if errors:
        raise field_errors(type(block), *errors)
    return block


def check_env_vars(value: dict[str, str], engine: str, remedy: str,
                    engine_env: frozenset = frozenset()) -> dict[str, str]:
    """The checks every engine's ``env_vars`` gets (names, no credentials, none of
    ``engine_env``); raises ValueError naming the first bad name. Socket interfaces:
    `socket_interfaces_checked`."""
    for name in value:
        if not ENV_NAME.match(name):
            raise ValueError(f"not an environment variable name (got {name!r}; expected letters, "
                             f"digits and '_', not starting with a digit)")
        if name in engine_env:
            raise ValueError(f"env_vars may not set {name}: the engine sets it (expected "
                             f"names other than {', '.join(sorted(engine_env))})")
        if is_credential_name(name):
            raise ValueError(f"env_vars may not carry credentials: the spec is rendered verbatim "
                             f"into the {engine} job (got {name}; expected no secret in the spec: "
                             f"{remedy})")
    return value


def dns_name(value: str, what: str, pattern: re.Pattern = DNS_LABEL) -> str:
    """``value`` when it matches ``pattern`` (an RFC 1123 name); ValueError naming ``what``
    otherwise. A label has at most 63 characters, a subdomain 253 (and may contain '.')."""
    limit = 253 if pattern is DNS_SUBDOMAIN else 63
    check_length(value, limit, what)
    if not pattern.match(value):
        dots = ", '-' and '.'" if pattern is DNS_SUBDOMAIN else " and '-'"
        raise ValueError(
            f"{what} must be a lowercase DNS name: letters a-z, digits{dots}, starting and "
            f"ending with a letter or digit, at most {limit} characters (got {value!r})"
        )
    return value
