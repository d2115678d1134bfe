"""Checks an Airflow container runs before it starts its process (the compose stack's entry point).

Every Airflow component of one deployment must share its keys: a scheduler or worker with
another JWT secret comes up and then fails every task with "Invalid auth token". So the stack's
one-off ``airflow-init`` records a fingerprint (a SHA-256, never the value) of each shared key
with ``record``, and each container compares its own with ``check`` before it starts: on a
mismatch it refuses, with one line naming the key. ``check`` also warns about environment
variables of the ``AIRFLOW__SECTION__KEY`` form that name a section or option Airflow does not
know (a misplaced key is otherwise ignored without a word). ``token`` is a worker's health check:
a task token signed as this container's executor signs them must be accepted by the API server.

    python -m trainforge.preflight record FILE                      # airflow-init
    python -m trainforge.preflight check FILE [ROLE [REFUSED_FILE]] # each container; 3: refused
    python -m trainforge.preflight token                            # 0: the API server accepts it
    python -m trainforge.preflight health FILE                      # 0: keys still as recorded

Without a recorded file (a deployment that does not record one) ``check`` compares nothing.
"""

from __future__ import annotations

import difflib
import hashlib
import json
import os
import sys
from pathlib import Path

#: The keys every Airflow component must share: (section, option).
SHARED_KEYS = (("api_auth", "jwt_secret"), ("core", "fernet_key"), ("api", "secret_key"))
#: Sections whose options are free-form (passed on as they are), checked by section only.
OPEN_SECTIONS = frozenset({"celery_broker_transport_options", "kubernetes_environment_variables",
                           "trainforge"})
#: Suffixes Airflow accepts on a variable for the value's source.
SOURCE_SUFFIXES = ("_CMD", "_SECRET")
REFUSED_EXIT = 3


def env_name(section: str, option: str) -> str:
    return f"AIRFLOW__{section.upper()}__{option.upper()}"


def fingerprint(section: str, option: str, value: str) -> str:
    """A SHA-256 of the value, labelled with its option (equal values of two keys differ)."""
    return hashlib.sha256(f"trainforge-preflight\0{section}\0{option}\0{value}".encode()).hexdigest()


def current_fingerprints(conf=None) -> dict[str, str]:
    """``{AIRFLOW__SECTION__KEY: fingerprint}`` of the shared keys as this process's Airflow
    configuration resolves them (environment, ``_CMD``, ``_SECRET``, airflow.cfg); a key not
    set anywhere is left out."""
    if conf is None:
        from airflow.configuration import conf
    out = {}
    for section, option in SHARED_KEYS:
        value = conf.get(section, option, fallback=None)
        if value:
            out[env_name(section, option)] = fingerprint(section, option, value)
    return out


def mismatches(recorded: dict[str, str], current: dict[str, str]) -> list[str]:
    """One line per shared key whose fingerprint differs from the recorded one."""
    lines = []
    for name in sorted(set(recorded) | set(current)):
        if recorded.get(name) != current.get(name):
            state = ("is not set here" if name not in current else
                     "was not set where airflow-init ran" if name not in recorded else "differs")
            lines.append(f"{name} {state}: every Airflow container of this deployment must "
                         f"share the value airflow-init recorded (docker/.env)")
    return lines


def _known_options(conf) -> dict[str, set[str]]:
    """Every section's options, the installed providers' included (loaded by Airflow)."""
    return {section: set((spec or {}).get("options") or {})
            for section, spec in conf.configuration_description.items()}


def unknown_variables(environ: dict[str, str], known: dict[str, set[str]]) -> list[str]:
    """A warning per ``AIRFLOW__SECTION__KEY`` variable whose section or option Airflow does not
    know, with the closest known name."""
    warnings = []
    sections = sorted(known)
    for name in sorted(environ):
        if not name.startswith("AIRFLOW__") or name.count("__") < 2:
            continue
        section, _, option = name[len("AIRFLOW__"):].lower().partition("__")
        for suffix in SOURCE_SUFFIXES:
            if option.endswith(suffix.lower()) and option[:-len(suffix)] in known.get(section, ()):
                option = option[:-len(suffix)]
        if section in OPEN_SECTIONS:
            continue
        if option in known.get(section, ()):
            continue
        owner = [s for s in sections if option in known[s]]
        if owner:
            hint = f"; [{owner[0]}] {option} is {env_name(owner[0], option)}"
        elif section in known:
            close = difflib.get_close_matches(option, sorted(known[section]), n=1)
            hint = f"; did you mean {env_name(section, close[0])}?" if close else ""
        else:
            close = difflib.get_close_matches(section, sections, n=1)
            hint = f"; did you mean [{close[0]}]?" if close else ""
        what = f"option {option} in [{section}]" if section in known else f"section [{section}]"
        warnings.append(f"{name}: Airflow has no {what}, the variable is ignored{hint}")
    return warnings


def record(path: Path) -> None:
    """Write the fingerprints of this process's shared keys to ``path`` (atomically)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    tmp.write_text(json.dumps(current_fingerprints(), indent=1, sort_keys=True) + "\n")
    os.replace(tmp, path)


def check(path: Path, role: str = "airflow", refused_file: Path | None = None) -> int:
    """Print the preflight's warnings and refusals; ``REFUSED_EXIT`` when a shared key differs
    from the recorded one (its lines also written to ``refused_file``), else 0."""
    from airflow.configuration import conf

    for warning in unknown_variables(dict(os.environ), _known_options(conf)):
        print(f"trainforge preflight: warning: {warning}", file=sys.stderr, flush=True)
    try:
        recorded = json.loads(path.read_text())
        if not (isinstance(recorded, dict)
                and all(isinstance(k, str) and isinstance(v, str) for k, v in recorded.items())):
            raise ValueError("not an object of fingerprints (written by `preflight record`)")
    except FileNotFoundError:
        print(f"trainforge preflight: no fingerprints recorded at {path}: the shared keys are "
              f"not compared", file=sys.stderr, flush=True)
        return 0
    except (OSError, ValueError) as err:
        return _refuse([f"cannot read {path}: {err}"], role, refused_file)
    return _refuse(mismatches(recorded, current_fingerprints(conf)), role, refused_file)


def _refuse(reasons: list[str], role: str, refused_file: Path | None) -> int:
    """Print (and keep in ``refused_file``) one line per reason; ``REFUSED_EXIT`` if any."""
    lines = [f"trainforge preflight: not starting {role}: {reason}" for reason in reasons]
    for line in lines:
        print(line, file=sys.stderr, flush=True)
    if lines and refused_file is not None:
        try:
            refused_file.write_text("".join(f"{line}\n" for line in lines))
        except OSError as err:
            print(f"trainforge preflight: cannot write {refused_file}: {err}", file=sys.stderr,
                  flush=True)
    return REFUSED_EXIT if lines else 0


def health(path: Path) -> int:
    """The health check's share (light: no Airflow import): the shared keys this container's
    environment sets still match what airflow-init recorded last. A key changed in docker/.env
    and one service recreated re-runs airflow-init too, which leaves the others behind."""
    try:
        recorded = json.loads(path.read_text())
    except FileNotFoundError:
        return 0
    except (OSError, ValueError) as err:
        print(f"trainforge preflight: cannot read {path}: {err}")
        return 1
    current = {env_name(section, option): fingerprint(section, option, value)
               for section, option in SHARED_KEYS
               if (value := os.environ.get(env_name(section, option)))}
    lines = [f"trainforge preflight: {name} differs from the value airflow-init recorded last: "
             f"the Airflow containers of this deployment no longer share one value; recreate "
             f"them all from one docker/.env (`up -d` with no service named)"
             for name in sorted(current) if isinstance(recorded, dict)
             and name in recorded and recorded[name] != current[name]]
    for line in lines:
        print(line)
    return 1 if lines else 0


def execution_api_url(conf) -> str:
    """Where task processes reach the Execution API (Airflow's own default when unset)."""
    url = conf.get("core", "execution_api_server_url", fallback=None)
    if not url:
        base = conf.get("api", "base_url", fallback=None) or "http://localhost:8080"
        url = f"{base.rstrip('/')}/execution/"
    return url if url.endswith("/") else f"{url}/"


def token_check(timeout_s: float = 10.0) -> int:
    """Ask the API server to accept a task token signed with this container's keys, as the
    executor signs them; 0 when accepted, 1 (with one line saying why) when not."""
    import urllib.error
    import urllib.request
    import uuid

    from airflow.api_fastapi.auth.tokens import JWTGenerator, get_signing_args
    from airflow.configuration import conf

    url = f"{execution_api_url(conf)}dags/trainforge-preflight-token-check"
    try:
        token = JWTGenerator(
            valid_for=60, audience=conf.get_mandatory_list_value("execution_api", "jwt_audience")[0],
            issuer=conf.get("api_auth", "jwt_issuer", fallback=None),
            **get_signing_args(make_secret_key_if_needed=False)).generate({"sub": str(uuid.uuid4())})
    except Exception as err:  # noqa: BLE001 - any configuration error is the answer
        print(f"trainforge preflight: cannot sign a task token: {err}", file=sys.stderr)
        return 1
    request = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"})
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as answer:
            body = answer.read(2000).decode("utf-8", "replace")
        if "trainforge-preflight-token-check" in body:
            return 0
        print(f"trainforge preflight: {url} is not Airflow's Execution API (HTTP 200 "
              f"{body[:200]!r}): check [core] execution_api_server_url", file=sys.stderr)
        return 1
    except urllib.error.HTTPError as err:
        detail = err.read(2000).decode("utf-8", "replace").strip()
        if err.code == 404 and "trainforge-preflight-token-check" in detail:
            return 0  # the Execution API took the token and looked for the (missing) DAG
        if err.code in (401, 403) and "Invalid auth token" in detail:  # the Execution API's
            print(f"trainforge preflight: the API server at {url} refused this container's "
                  f"task token (HTTP {err.code} {detail[:300]}): its [api_auth] jwt_secret (or "
                  f"jwt_private_key_path) differs from the API server's", file=sys.stderr)
        else:
            print(f"trainforge preflight: {url} is not Airflow's Execution API (HTTP "
                  f"{err.code} {detail[:200]}): check [core] execution_api_server_url",
                  file=sys.stderr)
    except (OSError, ValueError) as err:
        print(f"trainforge preflight: cannot reach the Execution API at {url}: {err}",
              file=sys.stderr)
    return 1


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if args[:1] == ["token"]:
        return token_check()
    if args[:1] == ["health"] and len(args) == 2:
        return health(Path(args[1]))
    if len(args) < 2 or args[0] not in ("record", "check"):
        print(__doc__.split("\n\n")[2], file=sys.stderr)
        return 2
    if args[0] == "record":
        record(Path(args[1]))
        return 0
    return check(Path(args[1]), args[2] if len(args) > 2 else "airflow",
                 Path(args[3]) if len(args) > 3 else None)


if __name__ == "__main__":
    sys.exit(main())
