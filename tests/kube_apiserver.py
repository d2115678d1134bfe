"""A real Kubernetes API server on loopback for tests (envtest style): etcd and kube-apiserver.

The binaries come from the folder named by ``KUBEBUILDER_ASSETS`` (the convention of the
Kubernetes ecosystem's envtest: ``etcd`` and ``kube-apiserver`` side by side), the upstream
CRDs from the folder named by ``TRAINFORGE_ENVTEST_CRDS`` (the YAML files as the projects
release them: Kubeflow Trainer's TrainJob, the training operator's PyTorchJob, Kueue's).

:class:`KubeApiServer` makes a CA, a serving certificate and a service-account key pair with
``cryptography``, starts etcd and the API server on free loopback ports (RBAC on, and
``OwnerReferencesPermissionEnforcement``, which OpenShift enables by default), applies the CRDs
and creates the namespaces, ServiceAccounts, LocalQueue and priority classes the tests use.

No controllers run: no garbage collector, no Kubeflow, JobSet or Kueue controller, no scheduler
and no kubelet. Objects are stored and validated (schema, CEL rules, strict fields, RBAC,
admission) but nothing acts on them; a test writes status through the status subresource as the
controller would, and names what it stands in for.
"""

from __future__ import annotations

import atexit
import datetime
import ipaddress
import os
import secrets
import shutil
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
from tests.ports import free_ports

ASSETS_ENV = "KUBEBUILDER_ASSETS"
CRDS_ENV = "TRAINFORGE_ENVTEST_CRDS"
#: The CRD files the suite applies (upstream release file names), and the older TrainJob CRDs
#: a test swaps in to check what an older Kubeflow Trainer refuses.
CRD_FILES = (
    "trainer-v2.3.0_trainjobs.yaml",
    "training-operator-v1.9.0_pytorchjobs.yaml",
    "kueue/kueue-v0.19.2_kueue.x-k8s.io_workloads.yaml",
    "kueue/kueue-v0.19.2_kueue.x-k8s.io_localqueues.yaml",
    "kueue/kueue-v0.19.2_kueue.x-k8s.io_clusterqueues.yaml",
    "kueue/kueue-v0.19.2_kueue.x-k8s.io_resourceflavors.yaml",
    "kueue/kueue-v0.19.2_kueue.x-k8s.io_workloadpriorityclasses.yaml",
)
OLDER_TRAINJOB_CRDS = ("trainer-v2.1.0_trainjobs.yaml", "trainer-v2.2.1_trainjobs.yaml")
NAMESPACES = ("default", "ml-train")


def missing() -> str | None:
    """What is missing to start the server (binaries, CRDs), or None."""
    assets = os.environ.get(ASSETS_ENV)
    if not assets:
        return f"{ASSETS_ENV} is not set"
    absent = [b for b in ("etcd", "kube-apiserver") if not os.access(Path(assets) / b, os.X_OK)]
    if absent:
        return f"{ASSETS_ENV}={assets} has no {' or '.join(absent)}"
    crds = os.environ.get(CRDS_ENV)
    if not crds:
        return f"{CRDS_ENV} is not set"
    lacking = [f for f in CRD_FILES + OLDER_TRAINJOB_CRDS if not (Path(crds) / f).is_file()]
    if lacking:
        return f"{CRDS_ENV}={crds} lacks {', '.join(lacking)}"
    return None


def _write_certificates(root: Path) -> None:
    """ca.crt, serving.crt/.key (for 127.0.0.1) and the service-account key pair sa.key/sa.pub."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import rsa
    from cryptography.x509.oid import NameOID

    def key() -> rsa.RSAPrivateKey:
        return rsa.generate_private_key(public_exponent=65537, key_size=2048)

    def pem(k: rsa.RSAPrivateKey) -> bytes:
        return k.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                               serialization.NoEncryption())

    now = datetime.datetime.now(datetime.timezone.utc)
    ca_key, serving_key, sa_key = key(), key(), key()
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "trainforge-test-ca")])
    ca = (x509.CertificateBuilder().subject_name(ca_name).issuer_name(ca_name)
          .public_key(ca_key.public_key()).serial_number(x509.random_serial_number())
          .not_valid_before(now - datetime.timedelta(minutes=5))
          .not_valid_after(now + datetime.timedelta(days=2))
          .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
          .sign(ca_key, hashes.SHA256()))
    serving = (x509.CertificateBuilder()
               .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")]))
               .issuer_name(ca_name).public_key(serving_key.public_key())
               .serial_number(x509.random_serial_number())
               .not_valid_before(now - datetime.timedelta(minutes=5))
               .not_valid_after(now + datetime.timedelta(days=2))
               .add_extension(x509.SubjectAlternativeName([
                   x509.IPAddress(ipaddress.ip_address("127.0.0.1")), x509.DNSName("localhost")]),
                   critical=False)
               .sign(ca_key, hashes.SHA256()))
    (root / "ca.crt").write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    (root / "serving.crt").write_bytes(serving.public_bytes(serialization.Encoding.PEM))
    (root / "serving.key").write_bytes(pem(serving_key))
    (root / "sa.key").write_bytes(pem(sa_key))
    (root / "sa.pub").write_bytes(sa_key.public_key().public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo))


def load_yaml_documents(path: Path) -> list[dict[str, Any]]:
    import yaml

    return [d for d in yaml.safe_load_all(path.read_text(encoding="utf-8")) if d]


class KubeApiServer:
    """etcd and kube-apiserver in ``root`` (an empty folder); :meth:`start`, then :meth:`stop`.

    :attr:`kubeconfig` is an admin's (``system:masters``); :meth:`service_account_kubeconfig`
    writes one for a ServiceAccount's token, bound to the rules given.
    """

    def __init__(self, root: Path):
        self.root = root
        self.assets = Path(os.environ[ASSETS_ENV])
        self.crds = Path(os.environ[CRDS_ENV])
        self.url = ""
        self.kubeconfig = root / "kubeconfig"
        self._processes: list[subprocess.Popen] = []
        self._token = secrets.token_hex(16)

    # -- lifecycle --------------------------------------------------------------------------
    def start(self, timeout_s: float = 90.0) -> None:
        _write_certificates(self.root)
        (self.root / "tokens.csv").write_text(f"{self._token},admin,admin,system:masters\n")
        etcd_port, peer_port, api_port = free_ports(3)
        etcd_url = f"http://127.0.0.1:{etcd_port}"
        self._spawn("etcd", [
            str(self.assets / "etcd"), "--data-dir", str(self.root / "etcd-data"),
            "--listen-client-urls", etcd_url, "--advertise-client-urls", etcd_url,
            "--listen-peer-urls", f"http://127.0.0.1:{peer_port}", "--log-level", "warn"])
        self._spawn("kube-apiserver", [
            str(self.assets / "kube-apiserver"), f"--etcd-servers={etcd_url}",
            "--bind-address=127.0.0.1", "--advertise-address=127.0.0.1",
            f"--secure-port={api_port}", f"--cert-dir={self.root / 'certs'}",
            f"--tls-cert-file={self.root / 'serving.crt'}",
            f"--tls-private-key-file={self.root / 'serving.key'}",
            f"--client-ca-file={self.root / 'ca.crt'}",
            f"--token-auth-file={self.root / 'tokens.csv'}", "--authorization-mode=RBAC",
            f"--service-account-key-file={self.root / 'sa.pub'}",
            f"--service-account-signing-key-file={self.root / 'sa.key'}",
            "--service-account-issuer=https://kubernetes.default.svc",
            "--service-cluster-ip-range=10.96.0.0/16", "--enable-priority-and-fairness=false",
            "--enable-admission-plugins=OwnerReferencesPermissionEnforcement"])
        self.url = f"https://127.0.0.1:{api_port}"
        self._write_kubeconfig(self.kubeconfig, "admin", {"token": self._token})
        self._wait_ready(timeout_s)
        for name in CRD_FILES:
            self.apply_crd(self.crds / name)
        self._create_test_objects()

    def stop(self) -> None:
        """Kill the API server and etcd, no grace period: their data goes with the folder, and
        the API server's graceful shutdown spent up to 14 s retrying an event post to etcd."""
        from tests.proctree import stop_tree

        stop_tree(self._processes, grace_s=0)
        self._processes.clear()

    def _spawn(self, name: str, argv: list[str]) -> None:
        out = open(self.root / f"{name}.log", "wb")  # noqa: SIM115 - lives as long as the process
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, cwd=self.root,
                                start_new_session=True)
        out.close()
        self._processes.append(proc)

    def log_tail(self, name: str = "kube-apiserver", lines: int = 15) -> str:
        path = self.root / f"{name}.log"
        text = path.read_text(errors="replace") if path.exists() else ""
        return "\n".join(text.splitlines()[-lines:])

    def _wait_ready(self, timeout_s: float) -> None:
        import requests

        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            for proc in self._processes:
                if proc.poll() is not None:
                    raise RuntimeError(f"{proc.args[0]} exited with {proc.returncode}:\n"
                                       f"{self.log_tail(Path(proc.args[0]).name)}")
            try:
                answer = requests.get(f"{self.url}/readyz", verify=str(self.root / "ca.crt"),
                                      headers={"Authorization": f"Bearer {self._token}"}, timeout=2)
                if answer.status_code == 200:
                    return
            except requests.RequestException:
                pass
            time.sleep(0.2)
        raise RuntimeError(f"kube-apiserver not ready after {timeout_s:.0f} s:\n{self.log_tail()}")

    # -- clients and identities -------------------------------------------------------------
    def _write_kubeconfig(self, path: Path, user: str, credentials: dict[str, str]) -> None:
        import json

        path.write_text(json.dumps({
            "apiVersion": "v1", "kind": "Config", "current-context": "envtest",
            "clusters": [{"name": "envtest", "cluster": {
                "server": self.url, "certificate-authority": str(self.root / "ca.crt")}}],
            "users": [{"name": user, "user": credentials}],
            "contexts": [{"name": "envtest", "context": {"cluster": "envtest", "user": user}}],
        }))

    def client(self) -> Any:
        """An admin ``kubernetes.client.ApiClient``."""
        from kubernetes import client, config

        cfg = client.Configuration()
        config.load_kube_config(str(self.kubeconfig), client_configuration=cfg)
        return client.ApiClient(cfg)

    def service_account_kubeconfig(self, namespace: str, name: str,
                                   rules: list[dict[str, Any]]) -> Path:
        """A kubeconfig with a token of ServiceAccount ``namespace/name``, which a Role of
        exactly ``rules`` is bound to (created or replaced)."""
        from kubernetes import client

        api = self.client()
        core, rbac = client.CoreV1Api(api), client.RbacAuthorizationV1Api(api)
        self._create(core.create_namespaced_service_account, namespace,
                     {"metadata": {"name": name}})
        role = {"metadata": {"name": name, "namespace": namespace}, "rules": rules}
        binding = {"metadata": {"name": name, "namespace": namespace},
                   "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": name},
                   "subjects": [{"kind": "ServiceAccount", "name": name, "namespace": namespace}]}
        rbac.delete_namespaced_role(name, namespace) if self._exists(
            rbac.read_namespaced_role, name, namespace) else None
        rbac.create_namespaced_role(namespace, role)
        self._create(rbac.create_namespaced_role_binding, namespace, binding)
        token = core.create_namespaced_service_account_token(
            name, namespace, {"spec": {"expirationSeconds": 3600}}).status.token
        path = self.root / f"kubeconfig-{namespace}-{name}"
        self._write_kubeconfig(path, f"{namespace}-{name}", {"token": token})
        return path

    @staticmethod
    def _create(fn: Any, *args: Any) -> None:
        from kubernetes.client.exceptions import ApiException

        try:
            fn(*args)
        except ApiException as err:
            if err.status != 409:
                raise

    @staticmethod
    def _exists(fn: Any, *args: Any) -> bool:
        from kubernetes.client.exceptions import ApiException

        try:
            fn(*args)
            return True
        except ApiException as err:
            if err.status == 404:
                return False
            raise

    # -- CRDs -------------------------------------------------------------------------------
    def apply_crd(self, path: Path, timeout_s: float = 30.0) -> None:
        """Create or replace the CRD of ``path`` and wait until the API serves it."""
        from kubernetes import client
        from kubernetes.client.exceptions import ApiException

        ext = client.ApiextensionsV1Api(self.client())
        for doc in load_yaml_documents(path):
            name = doc["metadata"]["name"]
            try:
                current = ext.read_custom_resource_definition(name)
            except ApiException as err:
                if err.status != 404:
                    raise
                ext.create_custom_resource_definition(doc)
            else:
                doc["metadata"]["resourceVersion"] = current.metadata.resource_version
                ext.replace_custom_resource_definition(name, doc)
            self._wait_established(ext, name, timeout_s)

    @staticmethod
    def _wait_established(ext: Any, name: str, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            conditions = ext.read_custom_resource_definition(name).status.conditions or []
            if any(c.type == "Established" and c.status == "True" for c in conditions):
                return
            time.sleep(0.1)
        raise RuntimeError(f"CRD {name} not Established after {timeout_s:.0f} s")

    @contextmanager
    def crd_swapped(self, file_name: str) -> Iterator[None]:
        """The CRD of ``file_name`` (of the CRDs folder) installed instead of the suite's one
        of the same name for the block; the suite's one restored after."""
        original = next(f for f in CRD_FILES
                        if load_yaml_documents(self.crds / f)[0]["metadata"]["name"]
                        == load_yaml_documents(self.crds / file_name)[0]["metadata"]["name"])
        self.apply_crd(self.crds / file_name)
        try:
            yield
        finally:
            self.apply_crd(self.crds / original)

    # -- what the tests share ---------------------------------------------------------------
    def _create_test_objects(self) -> None:
        from kubernetes import client

        api = self.client()
        core, custom = client.CoreV1Api(api), client.CustomObjectsApi(api)
        for ns in NAMESPACES:
            if ns != "default":
                self._create(core.create_namespace, {"metadata": {"name": ns}})
            # The ServiceAccount admission plugin wants each namespace's "default" account,
            # which the controller manager (not running here) would create.
            self._create(core.create_namespaced_service_account, ns, {"metadata": {"name": "default"}})
        self._create(client.SchedulingV1Api(api).create_priority_class,
                     {"metadata": {"name": "high"}, "value": 1000})
        kueue = ("kueue.x-k8s.io", "v1beta2")
        self._create(custom.create_cluster_custom_object, *kueue, "resourceflavors",
                     {"apiVersion": "kueue.x-k8s.io/v1beta2", "kind": "ResourceFlavor",
                      "metadata": {"name": "h100"}})
        self._create(custom.create_cluster_custom_object, *kueue, "clusterqueues",
                     {"apiVersion": "kueue.x-k8s.io/v1beta2", "kind": "ClusterQueue",
                      "metadata": {"name": "gpus"},
                      "spec": {"namespaceSelector": {}, "resourceGroups": [{
                          "coveredResources": ["nvidia.com/gpu"],
                          "flavors": [{"name": "h100", "resources": [
                              {"name": "nvidia.com/gpu", "nominalQuota": 16}]}]}]}})
        self._create(custom.create_cluster_custom_object, *kueue, "workloadpriorityclasses",
                     {"apiVersion": "kueue.x-k8s.io/v1beta2", "kind": "WorkloadPriorityClass",
                      "metadata": {"name": "high"}, "value": 1000})
        self._create(custom.create_namespaced_custom_object, *kueue, "ml-train", "localqueues",
                     {"apiVersion": "kueue.x-k8s.io/v1beta2", "kind": "LocalQueue",
                      "metadata": {"name": "team-a", "namespace": "ml-train"},
                      "spec": {"clusterQueue": "gpus"}})


_started: list[KubeApiServer] = []


@atexit.register
def _stop_left_over() -> None:  # an interpreter exit that skipped the fixture's teardown
    for server in _started:
        server.stop()


@pytest.fixture(scope="session")
def kube_apiserver(tmp_path_factory: pytest.TempPathFactory) -> Iterator[KubeApiServer]:
    """A real kube-apiserver for the session (see the module docstring); skips, saying what to
    install, without the binaries or CRDs."""
    from tests.conftest import skip_without

    absent = missing()
    if absent:
        skip_without("envtest", absent)
    root = tmp_path_factory.mktemp("kube-apiserver")
    server = KubeApiServer(root)
    _started.append(server)
    try:
        server.start()
        yield server
    finally:
        server.stop()
        _started.remove(server)
        shutil.rmtree(root, ignore_errors=True)
