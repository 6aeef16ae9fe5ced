"""/v1/responses kept in memory for `previous_response_id`: the newest `limit`, each with the whole
conversation it ended (its input items and its output items), so the next turn is rendered from them."""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass


@dataclass(frozen=True)
class StoredResponse:
    id: str
    items: tuple[dict, ...]  # the conversation as Responses input items, this response's output last
    instructions: str | None


class ResponseStore:
    """The newest `limit` stored responses by id; storing past it drops the oldest."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._by_id: OrderedDict[str, StoredResponse] = OrderedDict()

    def put(self, response: StoredResponse) -> None:
        if self.limit <= 0:
            return
        self._by_id[response.id] = response
        while len(self._by_id) > self.limit:
            self._by_id.popitem(last=False)

    def get(self, response_id: str) -> StoredResponse | None:
        return self._by_id.get(response_id)

    def __len__(self) -> int:
        return len(self._by_id)
