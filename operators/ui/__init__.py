"""Training in the Airflow UI: the Training page, the run view and the Cluster page.

A FastAPI app mounted by the plugin (trainforge.plugin, ``fastapi_apps``) under
:data:`~trainforge.ui.asgi.URL_PREFIX`, shown inside Airflow's UI as external views. Every
endpoint is behind Airflow's auth manager (trainforge.ui.access); data comes from Airflow's
metadata database (trainforge.ui.metadata), the MLflow server (trainforge.ui.mlflow_reader)
and the engines' status calls (trainforge.ui.cluster), each bounded by a timeout.
"""
