"""Id derivation rules (kvturn_langgraph._ids): pure functions of LangGraph's run metadata."""

from __future__ import annotations

from kvturn_langgraph._ids import ConversationPath, derive, fork_name, push_name, root_id


def meta(ns: str = "agent:0f1e", path: tuple[object, ...] = ("__pregel_pull", "agent"),
         node: str = "agent", **extra: object) -> dict[str, object]:
    return {"thread_id": "t-1", "langgraph_checkpoint_ns": ns, "langgraph_path": path,
            "langgraph_node": node, **extra}


def test_a_node_of_the_root_graph_is_the_thread() -> None:
    assert derive(meta()) == ConversationPath("t-1")
    assert str(derive(meta())) == "t-1"


def test_no_thread_uses_the_fallback_or_nothing() -> None:
    metadata = meta()
    del metadata["thread_id"]
    assert derive(metadata) is None
    assert derive(metadata, fallback="kvt-abc") == ConversationPath("kvt-abc")
    assert derive({"thread_id": ""}, fallback="kvt-abc") == ConversationPath("kvt-abc")


def test_subgraph_levels_are_forks_without_task_ids() -> None:
    step_3 = derive(meta(ns="research:aaaa|inner:bbbb|model:cccc"))
    step_5 = derive(meta(ns="research:dddd|inner:eeee|model:ffff"))
    assert step_3 == step_5 == ConversationPath("t-1", ("research", "inner"))
    # numeric disambiguation segments are not levels
    assert derive(meta(ns="research:aaaa|1|model:cccc")) == ConversationPath("t-1",
                                                                              ("research",))


def test_a_send_task_gets_its_index_and_a_send_started_subgraph_its_level_name() -> None:
    assert derive(meta(ns="mapper:aaaa", path=("__pregel_push", 2, False), node="mapper")) == \
        ConversationPath("t-1", ("mapper:2",))
    names = {"mapper:aaaa": "mapper:2"}
    assert derive(meta(ns="mapper:aaaa|model:bbbb"), level_name=names.get) == \
        ConversationPath("t-1", ("mapper:2",))
    nested = push_name("tools", ("__pregel_push", ("__pregel_pull", "agent"), 1, True))
    assert nested == "tools:agent.1"


def test_the_tool_call_is_the_leaf_and_keepalive_drops_the_leaf() -> None:
    push = meta(ns="tools:aaaa", path=("__pregel_push", 0, False), node="tools")
    assert derive(push, tool_call="call_7") == ConversationPath("t-1", ("call_7",))
    assert derive(push, keepalive=True) == ConversationPath("t-1")
    assert derive(meta(), node_fork="critic") == ConversationPath("t-1", ("critic",))
    assert derive(meta(), node_fork="critic", tool_call="c") == \
        ConversationPath("t-1", ("critic", "c"))


def test_names_outside_the_id_alphabet_are_encoded_and_long_ones_digested() -> None:
    assert root_id("plain-uuid-like") == "plain-uuid-like"
    assert root_id(42) == "42"
    assert root_id("chat with spaces/é") == "chat%20with%20spaces/%C3%A9"
    assert root_id("50%") == "50%"  # valid ids are kept as they are
    assert root_id("50% off") == "50%25%20off"
    long = root_id("x" * 300)
    assert long.startswith("lg-") and len(long) == 35 and root_id("x" * 300) == long
    assert fork_name("y" * 128) == "y" * 128 and fork_name("y" * 129).startswith("lg-")
    assert fork_name("") == "-"
