"""Every trainforge pipeline spec of this deployment becomes one Airflow DAG.

The specs: ``TRAINFORGE_PIPELINES`` or the Airflow setting ``[trainforge] pipelines`` (files or
folders, ``os.pathsep``-separated), else ``pipelines/`` beside this file; a spec with its own
generated DAG file (``python -m trainforge.dag_files FOLDER``) is compiled by that file instead.
This file is all a deployment needs in its DAGs folder: copy it there (see README, "Install").
"""

from trainforge.dag_files import folder_dags

globals().update(folder_dags(__file__))
