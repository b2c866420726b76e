"""The generation endpoints' entry (POST /v1/completions, /v1/chat/completions) and what they share:
the body is read, then answered as one request (router/request.py: the request's trip, phase by phase)
or as several choices answered together (router/many.py)."""

from __future__ import annotations

from fastapi import Request
from fastapi.responses import Response

from common.text.model_info import ModelInfo
from router.access import Access
from router.auth.keys import ApiKey
from router.config import RouterConfig
from router.errors import APIError
from router.many import handle_many, wants_many
from router.metrics import RouterMetrics
from router.orchestrator import Orchestrator
from router.outcome import Outcomes, Run
from router.parse import endpoint, read
from router.request import handle
from router.served_model import ServedModel


class Server:
    """Holds what the endpoints share; one per app."""

    def __init__(
        self,
        config: RouterConfig,
        model_info: ModelInfo,
        orch: Orchestrator,
        metrics: RouterMetrics,
        access: Access | None = None,
    ) -> None:
        self.config, self.orch, self.metrics, self.access = config, orch, metrics, access
        self.model = ServedModel.of(config, model_info)
        self.outcomes = Outcomes(metrics, config, self.model.name)

    async def generate(self, request: Request, chat: bool, key: ApiKey | None = None) -> Response:
        """POST /v1/completions (chat=False) or /v1/chat/completions (chat=True), for `key` (None while
        auth is off)."""
        body = await request.body()
        try:
            req = read(body, chat)
        except APIError as e:
            self.outcomes.refused(Run(endpoint(chat)), request, e)
            raise
        if wants_many(req):
            return await handle_many(self, request, req, key)
        return await handle(self, request, req, key)
