"""The Airflow plugin of trainforge: the plugin class Airflow's plugins manager loads from the
``airflow.plugins`` entry point (plugin), the MLflow run link on trainforge tasks (links), the
training pages inside Airflow's UI (ui) and the MLflow registry webhook receiver (webhooks).
"""
