"""One request under way: the values its phases made (router/request.py), which its response and its
end read."""

from __future__ import annotations

from dataclasses import dataclass

from common.text.detokenizer import IncrementalDetokenizer
from router.access import Admission
from router.openai_responses import Builder
from router.outcome import Run
from router.parse import Parsed
from router.record import RequestRecord
from router.trip import Trip


@dataclass
class Job:
    request_id: str
    parsed: Parsed  # phase 1
    admission: Admission | None  # phase 2: the key's rate-limit charge, released at the end
    trip: Trip  # phases 3 and 5: its placements, the services' output
    record: RequestRecord  # phase 4
    run: Run  # what the client got and when; the root span
    headers: dict[str, str]  # the response's: x-request-id, x-ratelimit-*, x-splitserve-route
    builder: Builder  # phase 6: the response's shapes
    detok: IncrementalDetokenizer  # phase 6: token ids to text, stop strings
    prompt_index: int = 0  # several choices: which prompt this one answers
