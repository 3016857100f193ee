"""The eventpush Airflow plugin: the control API and dashboard in Airflow's API server.

The app itself lives in ``eventpush.airflow.routes``; here it is only mounted at
``/eventpush`` and the dashboard is linked from the UI's navigation (shown inside the Airflow UI
at ``/plugin/eventpush``).
"""

from __future__ import annotations

from airflow.plugins_manager import AirflowPlugin

from eventpush.airflow.routes import create_app


class EventpushPlugin(AirflowPlugin):
    name = "eventpush"
    fastapi_apps = [
        {
            "app": create_app(),
            "url_prefix": "/eventpush",
            "name": "eventpush control API and dashboard",
        }
    ]
    external_views = [
        {
            "name": "Event push",
            "href": "eventpush/dashboard",
            "url_route": "eventpush",
            "destination": "nav",
            "category": "browse",
        }
    ]
