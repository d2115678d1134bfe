"""Who may see what: Airflow's auth manager behind every endpoint.

Airflow does not authenticate a plugin's FastAPI app by itself. Each route depends on
:data:`SignedInUser` (Airflow's own ``get_user``: the JWT of the UI's cookie or an
``Authorization: Bearer`` header, 401 without one), and reads only the DAGs the auth manager
lets that user read: :func:`readable_dag_ids` for lists, :func:`require_dag_read` (403) for one
DAG's data — the same calls Airflow's own routes make (airflow.api_fastapi.core_api.security).
"""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, HTTPException, status
from sqlalchemy.orm import Session

from airflow.api_fastapi.app import get_auth_manager
from airflow.api_fastapi.auth.managers.models.base_user import BaseUser
from airflow.api_fastapi.auth.managers.models.resource_details import DagAccessEntity, DagDetails
from airflow.api_fastapi.core_api.security import get_user
from airflow.configuration import conf
from airflow.models.dag import DagModel

SignedInUser = Annotated[BaseUser, Depends(get_user)]


def readable_dag_ids(user: BaseUser) -> set[str]:
    """The DAG ids the user may read."""
    return get_auth_manager().get_authorized_dag_ids(user=user, method="GET")


def require_dag_read(user: BaseUser, dag_id: str, session: Session,
                     entity: DagAccessEntity = DagAccessEntity.RUN) -> None:
    """Raise 403 unless the user may read ``entity`` of DAG ``dag_id``."""
    team = (DagModel.get_team_name(dag_id, session=session)
            if conf.getboolean("core", "multi_team", fallback=False) else None)
    if not get_auth_manager().is_authorized_dag(method="GET", access_entity=entity,
                                                details=DagDetails(id=dag_id, team_name=team),
                                                user=user):
        raise HTTPException(status.HTTP_403_FORBIDDEN, f"no read access to DAG {dag_id!r}")
