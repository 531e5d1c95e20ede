"""A conversation's next turn, submitted to whatever holds the conversations: one EngineServer, or the
ingress of engine replicas (ReplicaPool), which keeps them and ships each turn's history with it."""
from __future__ import annotations

import dataclasses

from engine.serve.conversation import ConversationError, ConversationStore, TurnRecorder
from engine.runtime.events import Error
from engine.runtime.request import Request, RequestError
from engine.serve.client import EngineClient, Submission


def submit_turn(server: EngineClient, store: ConversationStore, request: Request, conversation: str | None = None,
                branch_from_turn: int | None = None) -> Submission:
    """Submit a conversation's next turn to `server` (its `submit(request, recorder)` and `cancel`):
    `request` is the new instruction (with its own reference images, if any) and gets the conversation's
    turns as its history; without `conversation` it starts one; with `branch_from_turn` k it continues a
    new conversation holding the first k turns of `conversation`. `sub.conversation_id` names the
    conversation the turn is added to once it has made its image. Bad input (an unknown id, a turn it
    does not have) ends the stream with Error('invalid') and changes no conversation."""
    try:
        if request.history:
            raise RequestError("a conversation's turn takes its history from the conversation", "history")
        if conversation is None and branch_from_turn is not None:
            raise ConversationError("branch_from_turn needs the conversation_id to branch from", "branch_from_turn")
        turns = () if conversation is None else store.turns_until(conversation, branch_from_turn)
        made = conversation is None or branch_from_turn is not None
        parent = None if conversation is None else (conversation, branch_from_turn)
        conv = store.create(turns, parent) if made else store.get(conversation)
    except (ConversationError, RequestError) as e:
        return Submission.refused(request, Error("invalid", str(e), e.field), server.cancel)
    sub = server.submit(dataclasses.replace(request, history=turns),
                        lambda req, prepared: TurnRecorder(store, conv.id, req, prepared.bot_task))
    if sub.ended and made:             # refused: the conversation it would have started is not kept
        store.discard(conv.id)
    else:
        sub.conversation_id = conv.id
    return sub
