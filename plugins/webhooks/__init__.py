"""MLflow registry webhooks into Airflow assets: the receiver the plugin mounts (docs/registry.md)."""
