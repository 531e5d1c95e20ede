"""The studio's edit tab as a thread (issue 29 item 3): the thread's rules as pure functions, then one
thread of edits on the tiny engine through the studio's own handlers (continue, undo, branch), checked
against the conversations the engine holds."""
from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from PIL import Image as PILImage

from engine.runtime.request import MAX_IMAGES, MAX_TURNS
from studio_fixtures import CountingClient, engine_server, settings  # noqa: F401
from webui.options import Settings
from webui.thread import Thread, ThreadError, ThreadTurn, branched, check_next, continued, started, undone


def turn(name: str, conversation: str | None = "c1", refs: tuple[str, ...] = ()) -> ThreadTurn:
    return ThreadTurn(f"make it {name}", refs, f"<think>{name}</think>", f"/out/{name}.png", conversation)


def test_a_fresh_thread_starts_a_conversation_and_needs_references():
    t = Thread()
    assert t.submit_args() == (None, None)
    assert check_next(t, [], True)[0] == "images"
    assert check_next(t, ["a.png"], True) is None
    assert t.images_for(["a.png"], True) == t.images_for(["a.png"], False) == ["a.png"]
    assert started() == (Thread(), [])
    assert started("/out/x.png") == (Thread(), ["/out/x.png"])


def test_continue_undo_branch_and_start_over():
    t = continued(continued(continued(Thread(), turn("red", refs=("r.png",))), turn("blue")), turn("green"))
    assert [x.instruction for x in t.turns] == ["make it red", "make it blue", "make it green"]
    assert t.submit_args() == ("c1", None)                      # continue the last turn's conversation
    assert check_next(t, [], True) is None                       # later turns need no reference
    assert t.images_for(["more.png"], True) == ["more.png"]      # the engine adds the history itself

    rest, back = undone(t)                                       # undo: a branch from the turn before the last
    assert back == t.turns[-1] and rest.turns == t.turns[:2] and rest.cut
    assert rest.submit_args() == ("c1", 2)
    # the undone turn's answer, made in a new conversation, continues there
    t2 = continued(rest, turn("yellow", "c2"))
    assert not t2.cut and t2.submit_args() == ("c2", None)
    # branch from any turn: the conversation that holds that turn, cut after it
    assert branched(t2, 3).submit_args() == ("c2", 3)
    assert branched(t2, 2).submit_args() == ("c1", 2)
    assert branched(t2, 1).turns == t2.turns[:1]
    for bad in (0, 4, True, "1"):
        with pytest.raises(ThreadError):
            branched(t2, bad)

    first, back = undone(continued(Thread(), turn("red", refs=("r.png",))))   # undo the only turn
    assert first == Thread() and back.references == ("r.png",)
    with pytest.raises(ThreadError, match="no turn to undo"):
        undone(Thread())


def test_without_conversations_each_turn_edits_the_last_image():
    t = continued(Thread(), turn("red", None, ("r.png",)))
    assert t.images_for(["extra.png"], False) == ["/out/red.png", "extra.png"]
    assert check_next(t, ["a.png"] * (MAX_IMAGES - 1), False) is None
    assert check_next(t, ["a.png"] * MAX_IMAGES, False)[0] == "images"


def test_a_thread_stops_at_the_turns_a_conversation_keeps():
    t = Thread(tuple(turn(str(i)) for i in range(MAX_TURNS)))
    where, message = check_next(t, [], True)
    assert where == "prompt" and str(MAX_TURNS) in message
    assert check_next(branched(t, MAX_TURNS - 1), [], True) is None


def _run_turn(studio, prompt: str, refs: list[str], thread: Thread) -> Thread:
    """One Generate of the edit tab as the page runs it: the run's outputs, then the follow-up that adds
    the finished turn to the thread."""
    from webui.studio import Studio

    async def collect():
        return [o async for o in studio.generate(prompt, refs, Settings(*settings()), thread)]

    outs = asyncio.run(collect())
    assert outs[-1][0].startswith("Done"), outs[-1][0]
    new, refs_box, prompt_box = Studio.add_turn(thread, outs[-1][-1])
    assert refs_box == [] and prompt_box == ""
    return new


def test_a_three_turn_thread_with_an_undo_and_a_branch_on_the_engine(engine_server, tmp_path):
    """Three edits in a row, Undo, one more, Branch from turn 1, one more: each request reaches the engine
    as the turn of the right conversation, and the engine's conversations hold the thread's turns."""
    from webui.studio import Studio
    ref = tmp_path / "ref.png"
    PILImage.new("RGB", (64, 48), (200, 30, 30)).save(ref)
    client = CountingClient(engine_server)
    studio = Studio(client, engine_server.info, tmp_path / "out")
    assert studio.conversations

    t = _run_turn(studio, "make it blue", [str(ref)], Thread())
    t = _run_turn(studio, "add a star", [], t)
    t = _run_turn(studio, "make the star green", [], t)
    c1 = t.turns[0].conversation
    assert client.turns == [(None, None), (c1, None), (c1, None)]
    assert [x.conversation for x in t.turns] == [c1] * 3
    assert [x.prompt for x in engine_server.conversations.get(c1).turns] == \
        ["make it blue", "add a star", "make the star green"]
    assert all(Path(x.image).read_bytes()[:4] == b"\x89PNG" for x in t.turns)
    assert all(x.reasoning.startswith("[Thinking]") for x in t.turns)

    t, back = undone(t)
    assert back.instruction == "make the star green"
    t = _run_turn(studio, "make the star yellow", [], t)
    c2 = t.turns[-1].conversation
    assert client.turns[-1] == (c1, 2) and c2 != c1
    assert [x.prompt for x in engine_server.conversations.get(c2).turns] == \
        ["make it blue", "add a star", "make the star yellow"]
    assert len(engine_server.conversations.get(c1).turns) == 3          # the original is unchanged

    t = _run_turn(studio, "make it a square", [], branched(t, 1))
    c3 = t.turns[-1].conversation
    assert client.turns[-1] == (c1, 1)
    assert [x.instruction for x in t.turns] == ["make it blue", "make it a square"]
    assert [x.prompt for x in engine_server.conversations.get(c3).turns] == ["make it blue", "make it a square"]
    # each request carried only its own references; the engine added the history
    assert [len(r.images) for r in client.submitted] == [1, 0, 0, 0, 0]


class NoConversations:
    """The engine client a ReplicaPool is to the studio: submit, cancel, health, reload, no submit_turn."""

    def __init__(self, server):
        self.server, self.submitted = server, []

    def submit(self, request):
        self.submitted.append(request)
        return self.server.submit(request)

    def cancel(self, request_id):
        return self.server.cancel(request_id)

    def health(self):
        return self.server.health()

    def reload(self):
        return self.server.reload()


def test_a_client_without_conversations_chains_edits_of_the_last_image(engine_server, tmp_path):
    """Issue 29 item 3.4: behind a client without submit_turn the thread still works, each turn a single
    edit with the last image as its first reference, and the page says the client holds no conversations."""
    from webui.studio import Studio, build_studio
    from webui.thread_view import NO_CONVERSATIONS
    ref = tmp_path / "ref.png"
    PILImage.new("RGB", (64, 48), (30, 200, 30)).save(ref)
    client = NoConversations(engine_server)
    studio = Studio(client, engine_server.info, tmp_path / "out")
    assert not studio.conversations
    t = _run_turn(studio, "make it blue", [str(ref)], Thread())
    t = _run_turn(studio, "add a star", [str(ref)], t)
    assert [x.conversation for x in t.turns] == [None, None]
    first, second = client.submitted
    assert first.images == [str(ref)] and not first.history
    assert second.images == [t.turns[0].image, str(ref)] and not second.history
    problems = studio.validation("and a moon", [str(ref)] * 3, Settings(*settings()), ("prompt", "images"), t)
    assert "at most 2 more reference images fit (got 3)" in problems["images"]

    demo = build_studio(client, engine_server.info, out_dir=tmp_path / "o2", examples_dir=tmp_path / "ex")
    texts = [c.get("props", {}).get("value") for c in demo.config["components"]]
    assert NO_CONVERSATIONS in texts
    demo_one = build_studio(CountingClient(engine_server), engine_server.info, out_dir=tmp_path / "o3",
                            examples_dir=tmp_path / "ex")
    assert NO_CONVERSATIONS not in [c.get("props", {}).get("value") for c in demo_one.config["components"]]


def test_edit_this_result_continues_the_thread_or_starts_one():
    """'Edit this result' on the thread's last image keeps the thread (the next instruction continues
    it); on any other image (an earlier run, a history item) it starts a thread with that image as its
    one reference."""
    import gradio as gr
    from webui.studio import Studio
    t = continued(Thread(), turn("red", refs=("r.png",)))
    refs, tabs, thread = Studio.to_edit("/out/red.png", t)
    assert refs == thread == gr.skip() and tabs.selected == "ti2i"
    refs, tabs, thread = Studio.to_edit("/out/older.png", t)
    assert refs == ["/out/older.png"] and thread == Thread() and tabs.selected == "ti2i"
    assert Studio.to_edit("/out/red.png", Thread())[0] == ["/out/red.png"]


def test_a_thread_the_engine_no_longer_holds_says_how_to_go_on(engine_server, tmp_path):
    """A conversation the engine dropped (least recently used) is refused before it runs, and the page
    says what to do rather than only the engine's 'no conversation'."""
    import gradio as gr
    from webui.studio import LOST_THREAD, Studio
    studio = Studio(CountingClient(engine_server), engine_server.info, tmp_path / "out")
    outs = []

    async def collect():
        gone = continued(Thread(), turn("red", "conv_gone"))
        async for o in studio.generate("add a moon", [], Settings(*settings()), gone):
            outs.append(o)

    with pytest.raises(gr.Error, match="no conversation 'conv_gone'"):
        asyncio.run(collect())
    assert outs[-1][0].startswith("Request refused: no conversation") and outs[-1][0].endswith(LOST_THREAD)
