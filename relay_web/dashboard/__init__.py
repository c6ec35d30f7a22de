"""The server-rendered dashboard: Jinja2 pages and htmx partials over relay_core.

Made for an engineer on call with a phone: the landing page lists the newest
dead jobs, a job's page shows its error and a requeue button, and every page
fits 390 px without sideways scrolling. Reads and actions go through the same
relay_core functions as the JSON API; no job SQL lives here. ``create_app``
registers :data:`bp`.
"""

from __future__ import annotations

from flask.blueprints import BlueprintSetupState

from . import errors, views_auth, views_dead, views_jobs, views_overview, views_system
from .blueprint import bp
from .formatting import FILTERS, direction_controls_shown

__all__ = ["bp"]

# Importing the view modules registered their routes and error handlers on bp.
_VIEWS = (errors, views_auth, views_dead, views_jobs, views_overview, views_system)

for _name, _function in FILTERS.items():
    bp.add_app_template_filter(_function, _name)


@bp.record_once
def _show_direction_controls(state: BlueprintSetupState) -> None:
    """Every value the templates print goes through ``direction_controls_shown`` (before any template is compiled)."""
    state.app.jinja_env.finalize = direction_controls_shown
