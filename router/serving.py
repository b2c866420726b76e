"""The generation endpoints' entry (POST /v1/completions, /v1/chat/completions) and what they share:
the body is read and parsed (router/prep.py: off the loop when it is large), then answered as one
request (router/request.py: the request's trip, phase by phase) or as several choices answered together
(router/many.py). A request refused by its parse is charged to its key (Access.refused): whatever work
a body causes, its key pays for."""

from __future__ import annotations

from fastapi import Request
from fastapi.responses import Response

from common.text.model_info import ModelInfo
from router.access import Access
from router.auth.keys import ApiKey
from router.config import RouterConfig
from router.errors import APIError
from router.many import handle_many
from router.metrics import RouterMetrics
from router.orchestrator import Orchestrator
from router.outcome import Outcomes, Run
from router.parse import endpoint
from router.prep import Preparation, Prepared, parse_headers, prepare_generation
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
        self.prep = Preparation(config, self.model, metrics)

    async def generate(self, request: Request, chat: bool, key: ApiKey | None = None) -> Response:
        """POST /v1/completions (chat=False) or /v1/chat/completions (chat=True), for `key` (None while
        auth is off)."""
        body = await request.body()
        try:
            if self.access is not None:
                self.access.check_refusals(key)  # 429 while the key's refusals are spent
            prepared: Prepared = await self.prep.run(
                key, len(body), prepare_generation, body, chat, parse_headers(request.headers), key
            )
        except APIError as e:
            self.outcomes.refused(Run(endpoint(chat)), request, e)
            if self.access is not None and e.status == 400:  # the parse's work was done: charged
                await self.access.refused(key)
            raise
        if prepared.many:
            return await handle_many(self, request, prepared.req, prepared.parsed, key)
        return await handle(self, request, prepared.parsed[0][2], key)
