"""Training in the Airflow UI: the Training page, the run view and the Cluster page.

A FastAPI app mounted by the plugin (trainforge.plugins.plugin, ``fastapi_apps``) under
:data:`~trainforge.plugins.ui.asgi.URL_PREFIX`, shown inside Airflow's UI as external views. Every
endpoint is behind Airflow's auth manager (trainforge.plugins.ui.access); data comes from Airflow's
metadata database (trainforge.plugins.ui.metadata), the MLflow server (trainforge.plugins.ui.mlflow_reader)
and the engines' status calls (trainforge.plugins.ui.cluster), each bounded by a timeout.
"""
