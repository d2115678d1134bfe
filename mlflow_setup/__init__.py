"""Start and bootstrap the MLflow tracking server trainforge logs into.

Importing this package is cheap: ``mlflow`` itself is imported only by ``bootstrap()``.
"""

from trainforge.mlflow_setup.bootstrap import BootstrapError, BootstrapResult, bootstrap
from trainforge.mlflow_setup.errors import (
    HealthTimeoutError,
    MlflowSetupError,
    ServerStartError,
    ServerStopError,
    StoreArgumentError,
    StoreUnreachableError,
)
from trainforge.mlflow_setup.server import (
    ServerConfig,
    ServerExitedError,
    ServerHandle,
    build_server_command,
    start_server,
    stop_server,
    wait_healthy,
)

__all__ = [
    "BootstrapError",
    "BootstrapResult",
    "HealthTimeoutError",
    "MlflowSetupError",
    "ServerConfig",
    "ServerExitedError",
    "ServerHandle",
    "ServerStartError",
    "ServerStopError",
    "StoreArgumentError",
    "StoreUnreachableError",
    "bootstrap",
    "build_server_command",
    "start_server",
    "stop_server",
    "wait_healthy",
]
