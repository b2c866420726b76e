"""The generation endpoints' entry (POST /v1/completions, /v1/chat/completions) and what they share:
the body is read and parsed (router/prep.py: off the loop when it is large), then answered as one
request (router/request.py: the request's trip, phase by phase) or as several choices answered together
(router/many.py). A request refused by its parse is charged to its key (Access.refused): whatever work
a body causes, its key pays for.

A router may serve several models (router/served_model.py): a parsed request is answered by the
Server of the model it names (`for_model`), whose `model` and `outcomes` are that model's and whose
placement takes that model's services only (router/workers.py)."""

from __future__ import annotations

import copy
from collections.abc import Sequence

from fastapi import Request
from fastapi.responses import Response

from common.text.model_info import ModelInfo
from router.access import Access
from router.auth.keys import ApiKey
from router.config import RouterConfig
from router.errors import APIError
from router.many import handle_many
from router.metrics import NO_MODEL, RouterMetrics
from router.orchestrator import Orchestrator
from router.outcome import Outcomes, Run
from router.parse import endpoint
from router.prep import Preparation, Prepared, parse_headers, prepare_generation
from router.request import handle
from router.served_model import ServedModel, ServedModels


class Server:
    """Holds what the endpoints share; one per app, and one view of it per served model."""

    def __init__(
        self,
        config: RouterConfig,
        model_info: ModelInfo | Sequence[ModelInfo],
        orch: Orchestrator,
        metrics: RouterMetrics,
        access: Access | None = None,
    ) -> None:
        """`model_info`: each model of config.model, loaded, in its order (router/served_model.py)."""
        self.config, self.orch, self.metrics, self.access = config, orch, metrics, access
        infos = [model_info] if isinstance(model_info, ModelInfo) else list(model_info)
        self.models = ServedModels.of(config, infos)
        self.model: ServedModel = self.models.default
        # requests refused before they name a model: under the model's name when there is one only
        unknown = self.model.name if len(infos) == 1 else NO_MODEL
        self.outcomes = Outcomes(metrics, config, unknown)
        self.prep = Preparation(config, self.models, metrics)
        orch.pool.serve(self.models)
        metrics.serve_models([*self.models.names, unknown])
        self._views: dict[str, Server] = {}  # shared with the views (a shallow copy shares the dict)
        self._views.update({m.name: self._view(m) for m in self.models.models})

    def _view(self, model: ServedModel) -> Server:
        """This server as the requests for `model` see it: its name, template and fingerprint in their
        answers, counted under its name. Everything else is shared (a shallow copy)."""
        view = copy.copy(self)
        view.model, view.outcomes = model, Outcomes(self.metrics, self.config, model.name)
        return view

    def for_model(self, name: str) -> Server:
        """The server of the served model named `name` (a Parsed request's `model`)."""
        return self._views[name]

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
        server = self.for_model(prepared.parsed[0][2].model)
        if prepared.many:
            return await handle_many(server, request, prepared.req, prepared.parsed, key)
        return await handle(server, request, prepared.parsed[0][2], key)
