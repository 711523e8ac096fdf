"""Episodes: single-turn completions, or multi-turn tool use, sampled in batches.

An agentic environment lets the policy call a tool by writing a tool block and ending its turn; the
tool runs (sandboxed where it runs code), its output is appended as a ``tool`` message rendered by the
model's own chat template, and the policy continues, until it answers without a tool call or reaches
the environment's turn limit. Every turn is kept. The episode's completion is every token after the
prompt, the policy's own and the tool messages'; ``loss_mask`` marks the policy's own tokens, the only
ones the update trains on (tool output is context, not action).

Turns are batched: all episodes' first turns decode together, then every episode that called a tool
continues in the next batch, and so on.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from evertrain.envs.base import Environment, Problem, earlier_calls
from evertrain.envs.tools import format_tool_result, parse_tool_call, stop_strings
from evertrain.inference.base import Sample, Sampler, SamplingStats

PLACEHOLDER = "\u2063EVERTRAIN-ASSISTANT-TURN\u2063"


@dataclass
class Episode:
    """One attempt at a problem: every token after the prompt, which ones are the policy's, every turn."""

    completion_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)  # 0.0 where the token is not the policy's
    loss_mask: list[int] = field(default_factory=list)  # 1: a policy token (trained on); 0: tool output
    turns: list[dict[str, Any]] = field(default_factory=list)
    finish_reason: str = "stop"
    text: str = ""  # the final assistant turn: what the verifier grades
    tool_calls: int = 0
    tool_errors: int = 0
    rework: int = 0  # tool calls made after an earlier call failed (retries after an error)
    sandbox_runs: list[dict[str, Any]] = field(default_factory=list)

    def add_policy_turn(self, s: Sample) -> None:
        start = len(self.completion_ids)
        self.completion_ids += s.completion_ids
        self.logprobs += s.logprobs
        self.loss_mask += [1] * len(s.completion_ids)
        self.turns.append({"role": "assistant", "content": s.text, "tokens": [start, len(self.completion_ids)]})
        self.finish_reason, self.text = s.finish_reason, s.text

    @classmethod
    def single_turn(cls, s: Sample) -> Episode:
        episode = cls()
        episode.add_policy_turn(s)
        return episode


def turn_seed(group_seed: int, turn: int, sample: int) -> int:
    """The seed of one episode's later turn, from its group's seed alone (not its place in a batch)."""
    return (group_seed * 1_000_003 + turn * 1_009 + sample) & 0x7FFFFFFF


def tool_message_ids(tokenizer: Any, messages: list[dict[str, str]], tool_message: dict[str, str],
                     eos_text: str) -> list[int]:
    """Tokens that follow an assistant turn ended by ``eos_text``: the tool message and the next assistant
    header, exactly as the model's chat template renders them."""
    rendered = tokenizer.apply_chat_template(
        [*messages, {"role": "assistant", "content": PLACEHOLDER}, tool_message],
        tokenize=False, add_generation_prompt=True)
    suffix = rendered[rendered.index(PLACEHOLDER) + len(PLACEHOLDER):]
    suffix = suffix.removeprefix(eos_text)  # the policy already produced the end-of-turn token
    return tokenizer(suffix, add_special_tokens=False)["input_ids"]


def sample_episodes(sampler: Sampler, env: Environment, problems: list[Problem],
                    prompts: list[list[int]], n: int, *, max_new_tokens: int, temperature: float = 1.0,
                    top_p: float = 1.0, greedy: bool = False, batch_size: int = 64, seed: int = 0,
                    progress: Any = None, tool_workers: int = 2,
                    seeds: list[int] | None = None) -> tuple[list[list[Episode]], SamplingStats]:
    """``n`` episodes per problem of one environment (single- or multi-turn), with sampling statistics.

    ``sampler`` is any :class:`~evertrain.inference.base.Sampler` (the in-house one, a vLLM engine's).

    ``seeds`` (one per problem) seed each group on its own (see ``sample``), later turns included, so a
    group's episodes do not depend on the batch it was sampled in.
    """
    conversational = env.conversational and env.max_turns > 1
    agentic = conversational or (bool(env.tools) and env.max_turns > 1)
    stops: tuple[str, ...] = ()
    if agentic and not conversational:
        stops = tuple(stop_strings(env.tools))
    tokenizer = sampler.tokenizer
    groups, stats = sampler.sample(prompts, n, max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p,
                                   greedy=greedy, batch_size=batch_size, seed=seed, progress=progress,
                                   stop_strings=stops, seeds=seeds)
    episodes = [[Episode.single_turn(s) for s in group] for group in groups]
    if not agentic:
        return episodes, stats

    eos_text = tokenizer.eos_token or ""
    chats = [env.guided_messages(p) for p in problems]  # the prompt as curated: with its hint, if any
    history: dict[tuple[int, int], list[dict[str, str]]] = {}
    for turn in range(1, env.max_turns):
        live = [(g, i) for g, group in enumerate(episodes) for i, episode in enumerate(group)
                if episode.finish_reason != "length" and sum(t["role"] == "assistant" for t in episode.turns) == turn]
        if conversational:  # the environment itself answers each turn
            with ThreadPoolExecutor(max_workers=tool_workers) as pool:
                said = list(pool.map(lambda item: _reply(env, problems[item[0]], episodes[item[0]][item[1]].turns),
                                     live))
            spoken = [(g, i, text) for (g, i), text in zip(live, said, strict=True) if text is not None]
            if not spoken:
                break
            contexts, owners = _environment_turns(tokenizer, episodes, chats, history, spoken, prompts, eos_text)
            more, more_stats = sampler.sample(contexts, 1, max_new_tokens=max_new_tokens, temperature=temperature,
                                              top_p=top_p, greedy=greedy, batch_size=batch_size, seed=seed + turn,
                                              seeds=None if seeds is None else
                                              [turn_seed(seeds[g], turn, i) for g, i in owners])
            stats.merge(more_stats)
            for (g, i), continuation in zip(owners, more, strict=True):
                episodes[g][i].add_policy_turn(continuation[0])
            continue
        pending = [(g, i, call) for g, i in live
                   if (call := parse_tool_call(episodes[g][i].text, env.tools)) is not None]
        if not pending:
            break

        def run(item: tuple[int, int, Any]) -> Any:
            g, i, call = item
            return env.tools[call.name].run_after(earlier_calls(episodes[g][i].turns, call.name), call.input,
                                                  problems[g])

        with ThreadPoolExecutor(max_workers=tool_workers) as pool:
            results = list(pool.map(run, pending))
        contexts, owners = [], []
        for (g, i, call), result in zip(pending, results, strict=True):
            episode = episodes[g][i]
            episode.rework += int(episode.tool_errors > 0)
            episode.tool_calls += 1
            episode.tool_errors += int(result.error)
            episode.sandbox_runs += list(getattr(result, "sandbox_runs", []) or [])
            message = {"role": "tool", "content": format_tool_result(call.name, result)}
            tokens = _append_context(tokenizer, episode, history.setdefault((g, i), list(chats[g])), message,
                                     eos_text)
            episode.turns.append({"role": "tool", "name": call.name, "input": call.input,
                                  "content": message["content"], "output": result.output, "error": result.error,
                                  "tokens": tokens})
            contexts.append(prompts[g] + episode.completion_ids)
            owners.append((g, i))
        more, more_stats = sampler.sample(contexts, 1, max_new_tokens=max_new_tokens,
                                          temperature=temperature, top_p=top_p, greedy=greedy, batch_size=batch_size,
                                          seed=seed + turn, stop_strings=stops,
                                  seeds=None if seeds is None else [turn_seed(seeds[g], turn, i) for g, i in owners])
        stats.merge(more_stats)
        for (g, i), continuation in zip(owners, more, strict=True):
            episodes[g][i].add_policy_turn(continuation[0])
    if hasattr(env, "episode_text"):  # graded on the whole episode (a terminal's command log), not the last turn
        for group in episodes:
            for episode in group:
                episode.text = env.episode_text(episode.turns)
    return episodes, stats


def _environment_turns(tokenizer: Any, episodes: list[list[Episode]], chats: list[list[dict[str, str]]],
                       history: dict[tuple[int, int], list[dict[str, str]]], spoken: list[tuple[int, int, str]],
                       prompts: list[list[int]], eos_text: str) -> tuple[list[list[int]], list[tuple[int, int]]]:
    """Append what a conversational environment said to each episode as a ``user`` turn (context, never trained
    on: its tokens are masked like tool output); returns the contexts to continue and whose they are."""
    contexts, owners = [], []
    for g, i, text in spoken:
        episode = episodes[g][i]
        message = {"role": "user", "content": text}
        tokens = _append_context(tokenizer, episode, history.setdefault((g, i), list(chats[g])), message, eos_text)
        episode.turns.append({"role": "user", "content": text, "tokens": tokens})
        contexts.append(prompts[g] + episode.completion_ids)
        owners.append((g, i))
    return contexts, owners


def _append_context(tokenizer: Any, episode: Episode, chat: list[dict[str, str]], message: dict[str, str],
                    eos_text: str) -> list[int]:
    """Append ``message`` (a tool's output, or what the environment said) after the episode's last policy turn:
    its tokens as the model's chat template renders them, never trained on (logprob 0, loss mask 0). Returns the
    [start, end) of its tokens in the episode's completion."""
    chat.append({"role": "assistant", "content": episode.turns[-1]["content"]})
    # a turn cut at a tool's closing tag has not produced the end-of-turn token: the template's is then part of the
    # (untrained) message
    ids = tool_message_ids(tokenizer, chat, message, eos_text if episode.finish_reason == "stop" else "")
    chat.append(message)
    start = len(episode.completion_ids)
    episode.completion_ids += ids
    episode.logprobs += [0.0] * len(ids)
    episode.loss_mask += [0] * len(ids)
    return [start, len(episode.completion_ids)]


def _reply(env: Environment, problem: Problem, turns: list[dict[str, Any]]) -> str | None:
    """What a conversational environment says next; an environment that fails ends that episode alone (its grade
    then says why), never the batch."""
    try:
        return env.reply(problem, turns)
    except Exception:
        return None
