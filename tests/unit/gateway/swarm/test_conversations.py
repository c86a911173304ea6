"""Kept conversations: which one a prompt continues (scope, longest prefix), one request at a time, LRU and expiry."""

from __future__ import annotations

from gateway.swarm.conversations import ConversationPool, common_prefix

CHAT = list(range(100, 140))  # a conversation's 40 tokens, as the nodes' caches hold them


def pool(keep_alive: float = 60.0, max_kept: int = 4) -> tuple[ConversationPool[str], list[float]]:
    now = [0.0]
    return ConversationPool(keep_alive, max_kept, clock=lambda: now[0]), now


def test_common_prefix() -> None:
    assert common_prefix([1, 2, 3], [1, 2, 4, 5]) == 2
    assert common_prefix([1, 2], [1, 2, 3]) == 2
    assert common_prefix([], [1]) == 0


def test_a_prompt_continuing_a_conversation_takes_it_with_its_shared_prefix() -> None:
    conversations, _ = pool()
    assert conversations.keep("key-a", CHAT, "chain") == []
    # The re-rendered reply differs from the generated ids after 35 tokens: only those are reused.
    taken = conversations.take("key-a", [*CHAT[:35], 7, 8, 9])
    assert taken is not None and (taken.item, taken.prefix) == ("chain", 35)
    assert len(conversations) == 0


def test_at_least_one_prompt_token_is_left_to_prefill() -> None:
    conversations, _ = pool()
    conversations.keep("key-a", CHAT, "chain")
    taken = conversations.take("key-a", CHAT[:30])  # the same prompt again (a regenerate): it gives the logits
    assert taken is not None and taken.prefix == 29


def test_other_scopes_and_short_overlaps_never_take_a_conversation() -> None:
    conversations, _ = pool()
    conversations.keep("key-a", CHAT, "chain")
    assert conversations.take("key-b", [*CHAT, 1]) is None
    # A new chat that shares only the system prompt would rewind someone's caches for little: left alone.
    assert conversations.take("key-a", [*CHAT[:19], 5, 6]) is None
    assert conversations.take("key-a", [5, 6]) is None
    assert len(conversations) == 1


def test_the_longest_shared_prefix_wins_and_ties_go_to_the_most_recent() -> None:
    conversations, _ = pool()
    conversations.keep("key-a", CHAT[:30], "short")
    conversations.keep("key-a", CHAT, "long")
    conversations.keep("key-a", CHAT, "long, newer")
    taken = conversations.take("key-a", [*CHAT, 1, 2])
    assert taken is not None and (taken.item, taken.prefix) == ("long, newer", 40)
    taken = conversations.take("key-a", [*CHAT, 1, 2])
    assert taken is not None and taken.item == "long"
    taken = conversations.take("key-a", [*CHAT, 1, 2])
    assert taken is not None and (taken.item, taken.prefix) == ("short", 30)


def test_a_taken_conversation_serves_one_request_until_it_is_kept_again() -> None:
    conversations, _ = pool()
    conversations.keep("key-a", CHAT, "chain")
    first = conversations.take("key-a", [*CHAT, 1])
    assert first is not None
    assert conversations.take("key-a", [*CHAT, 1]) is None  # a concurrent request prefills afresh
    conversations.keep("key-a", [*CHAT, 1, 2], first.item)  # turn 2 ended well: back, holding more
    second = conversations.take("key-a", [*CHAT, 1, 2, 3])
    assert second is not None and (second.item, second.prefix) == ("chain", 42)


def test_beyond_max_kept_the_least_recently_kept_is_evicted() -> None:
    conversations, now = pool(max_kept=2)
    for name in ("a", "b"):
        now[0] += 1
        assert conversations.keep(name, CHAT, name) == []
    now[0] += 1
    assert conversations.keep("c", CHAT, "c") == ["a"]
    assert conversations.take("a", [*CHAT, 1]) is None
    taken = conversations.take("b", [*CHAT, 1])
    assert taken is not None
    conversations.keep("b", CHAT, "b")  # used again: now the most recent
    assert conversations.keep("d", CHAT, "d") == ["c"]


def test_conversations_expire_after_keep_alive() -> None:
    conversations, now = pool(keep_alive=10)
    conversations.keep("key-a", CHAT, "old")
    now[0] = 6
    conversations.keep("key-a", CHAT[:39], "new")
    now[0] = 10.5
    taken = conversations.take("key-a", [*CHAT, 1])  # "old" holds more but is past its time, even before a sweep
    assert taken is not None and taken.item == "new"
    conversations.keep("key-a", CHAT, "new again")
    assert conversations.expired() == ["old"]
    now[0] = 100
    assert conversations.expired() == ["new again"] and len(conversations) == 0


def test_nothing_is_kept_when_disabled_and_remove_if_and_clear_hand_back_items() -> None:
    disabled, _ = pool(keep_alive=0)
    assert not disabled.enabled and disabled.keep("key-a", CHAT, "chain") == ["chain"] and len(disabled) == 0
    conversations, _ = pool()
    for name in ("a", "b", "c"):
        conversations.keep("key-a", CHAT, name)
    assert conversations.remove_if(lambda item: item == "b") == ["b"]
    assert conversations.clear() == ["a", "c"] and len(conversations) == 0
