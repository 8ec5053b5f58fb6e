"""OpenEnv environments: `rollout.environment = "openenv:<url>[#option=value&...]"`.

The environment is an OpenEnv server someone runs (`openenv-core` 0.3.0's `create_app` /
`create_fastapi_app`, a Space, a container) at `<url>` (http(s):// or ws(s)://, its base).
Each episode is one WebSocket session on `<url>/ws`: in 0.3.0 the HTTP `/reset` and `/step`
each build a fresh environment, so only a session keeps an episode's state. The wire protocol
(the same in `openenv` 0.4.1 to 0.10.0) is JSON text frames:

    -> {"type": "reset", "data": {"seed": 17}}      <- {"type": "observation", "data": {"observation": {...},
    -> {"type": "step", "data": <action>}                "reward": float | null, "done": bool}}
    -> {"type": "close"}                             <- {"type": "error", "data": {"message": ..., "code": ...}}

spoken here with `websockets` alone (no openenv import in the rollout worker), every frame bounded
(`max_bytes`), checked (JSON, its shape, a finite reward) and awaited at most `timeout_s`.

The prompts. Record k is reset seed s_k: `task.num_train` train seeds and `task.num_eval` eval
seeds drawn without replacement from [0, 2^31) by the run's seed, so the splits are disjoint. At
prepare each seed is reset once, over one session, and its rendered observation is the record's
prompt (which also checks the server is there). The answer is the reset's kwargs as JSON: an
environment grades itself, there is no reference (so `sft.enabled=false`, checked by the config).

An episode: reset with the record's seed; then, up to `turns` times, the observation rendered
as a user message, the model's reply through the proxy (the `openai` SDK), the reply's text made
the action, a step. Its reward is the sum of the steps' rewards (None counts 0; the reset's is
not counted); it ends at `done`, after `turns` steps, or when the conversation outgrows the
model's context. Every action's `metadata` carries the `completion_id` of the reply it came from;
the rows' `reward_info["openenv"]` has the steps' rewards and how the episode ended.

Options (the URL's fragment, never sent to the server):
    turns=4            steps per episode at most
    action=<field>     the action's string field the reply's text fills; default: the single
                       string field of the action schema (`GET <url>/schema`), else refused at prepare
    action=pkg.mod:fn  fn(text, observation) -> the action's JSON dict
    observation=<field> | pkg.mod:fn   what the model reads: that field of the observation, or
                       fn(observation) -> str; default: its single string field, else its JSON
    timeout_s=60       connect and per-message timeout
    max_bytes=1048576  the largest frame (or schema) read
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import importlib.util
import json
import math
import random
from dataclasses import dataclass
from typing import Any
from urllib.parse import parse_qsl, urlsplit, urlunsplit

from areal_core.config.base import ConfigError
from areal_core.config.hooks import import_object

KEY = "rollout.environment"
MODEL = "areal-policy"
DEFAULTS: dict[str, Any] = {"turns": 4, "timeout_s": 60.0, "max_bytes": 1 << 20, "action": "", "observation": ""}
SEED_SPACE = 2**31
LOOPBACK = {"127.0.0.1", "localhost", "::1"}


class OpenEnvError(RuntimeError):
    """The server misbehaved or went away: the episode fails (counted by the agent workflow)."""


@dataclass(frozen=True)
class Spec:
    url: str  # http(s)://host:port/path, the server's base
    ws_url: str  # ws(s)://host:port/path/ws
    turns: int
    timeout_s: float
    max_bytes: int
    action: str
    observation: str

    @property
    def local(self) -> bool:
        return (urlsplit(self.url).hostname or "") in LOOPBACK


def _short(value: Any, n: int = 120) -> str:
    """A value for an error line: a string quoted, anything else as its repr; one line, at most ~n characters."""
    text = " ".join((value if isinstance(value, str) else repr(value)).split())
    text = text[:n] + ("..." if len(text) > n else "")
    return repr(text) if isinstance(value, str) else text


def parse_spec(spec: str) -> Spec:
    """`http://host:8000#turns=2&action=message` -> Spec; a one-line ConfigError naming rollout.environment."""
    base, _, fragment = str(spec).strip().partition("#")
    parts = urlsplit(base)
    schemes = {"http": "ws", "https": "wss", "ws": "ws", "wss": "wss"}
    if parts.scheme not in schemes or not parts.hostname:
        raise ConfigError(f"config key '{KEY}': openenv needs the server's URL (http(s):// or ws(s)://), got {spec!r}")
    opts = dict(DEFAULTS)
    for name, value in parse_qsl(fragment, keep_blank_values=True):
        if name not in DEFAULTS:
            raise ConfigError(f"config key '{KEY}': unknown openenv option {name!r} (options: {sorted(DEFAULTS)})")
        try:
            opts[name] = type(DEFAULTS[name])(value)
        except ValueError:
            raise ConfigError(f"config key '{KEY}': openenv option {name}={value!r} is not a number") from None
    if opts["turns"] < 1 or opts["timeout_s"] <= 0 or opts["max_bytes"] < 1024:
        raise ConfigError(f"config key '{KEY}': openenv needs turns >= 1, timeout_s > 0, max_bytes >= 1024: {spec!r}")
    path = parts.path.rstrip("/")
    http_scheme = {"ws": "http", "wss": "https"}.get(parts.scheme, parts.scheme)
    url = urlunsplit((http_scheme, parts.netloc, path, "", ""))
    ws_url = urlunsplit((schemes[parts.scheme], parts.netloc, path + "/ws", "", ""))
    return Spec(url, ws_url, opts["turns"], opts["timeout_s"], opts["max_bytes"], opts["action"], opts["observation"])


# ---------------------------------------------------------------------------------------------
# One session: bounded, checked frames
# ---------------------------------------------------------------------------------------------
@dataclass
class Result:
    observation: dict[str, Any]
    reward: float | None
    done: bool


def check_result(data: Any, where: str) -> Result:
    """An observation frame's `data`: {"observation": dict, "reward": finite number | None, "done": bool}."""
    if not isinstance(data, dict) or not isinstance(data.get("observation"), dict):
        raise OpenEnvError(f"{where}: an observation frame needs data.observation (an object), got {_short(data)}")
    reward = data.get("reward")
    if isinstance(reward, bool):
        reward = float(reward)
    elif reward is not None:
        if not isinstance(reward, (int, float)) or not math.isfinite(reward):
            raise OpenEnvError(f"{where}: the reward must be a finite number or null, got {_short(reward)}")
        reward = float(reward)
    done = data.get("done", False)
    if not isinstance(done, bool):
        raise OpenEnvError(f"{where}: done must be true or false, got {_short(done)}")
    return Result(data["observation"], reward, done)


class Session:
    """One WebSocket session on the server: `async with Session(spec) as s: await s.reset(seed=1)`."""

    def __init__(self, spec: Spec):
        self.spec = spec
        self.ws: Any = None

    async def __aenter__(self) -> Session:
        from websockets.asyncio.client import connect

        try:
            self.ws = await connect(
                self.spec.ws_url,
                open_timeout=self.spec.timeout_s,
                max_size=self.spec.max_bytes,
                max_queue=4,
                close_timeout=min(5.0, self.spec.timeout_s),
                proxy=None if self.spec.local else True,
            )
        except Exception as exc:  # noqa: BLE001 - refused, DNS, a handshake the server failed, a timeout
            raise OpenEnvError(f"cannot reach the OpenEnv server at {self.spec.ws_url} ({_error(exc)})") from None
        return self

    async def __aexit__(self, *exc: Any) -> None:
        if self.ws is None:
            return
        try:  # the server ends the session and closes the socket: closing first makes it log a traceback
            wait = min(5.0, self.spec.timeout_s)
            await asyncio.wait_for(self.ws.send(json.dumps({"type": "close"})), wait)
            await asyncio.wait_for(self.ws.wait_closed(), wait)
        except Exception:  # noqa: BLE001 - best effort: the server also ends the session when the socket closes
            pass
        try:
            await asyncio.wait_for(self.ws.close(), 2 * min(5.0, self.spec.timeout_s))
        except Exception:  # noqa: BLE001
            pass
        self.ws = None

    def where(self, kind: str) -> str:
        return f"OpenEnv server {self.spec.ws_url} ({kind})"

    async def reset(self, **kwargs: Any) -> Result:
        return check_result(await self.exchange({"type": "reset", "data": kwargs}), self.where("reset"))

    async def step(self, action: dict[str, Any]) -> Result:
        return check_result(await self.exchange({"type": "step", "data": action}), self.where("step"))

    async def exchange(self, message: dict[str, Any]) -> Any:
        """Send one frame, read one: the `data` of an observation frame; an error frame raises."""
        from websockets.exceptions import ConnectionClosed

        where = self.where(message["type"])
        try:
            try:
                await asyncio.wait_for(self.ws.send(json.dumps(message)), self.spec.timeout_s)
            except ConnectionClosed:
                pass  # closed after a last frame (a capacity refusal, say): recv gives that frame, else raises
            raw = await asyncio.wait_for(self.ws.recv(), self.spec.timeout_s)
        except TimeoutError:
            raise OpenEnvError(f"{where}: no answer within {self.spec.timeout_s:g} s") from None
        except UnicodeDecodeError:
            raise OpenEnvError(f"{where}: a text frame that is not UTF-8") from None
        except ConnectionClosed as exc:
            sent = getattr(exc, "sent", None)
            if sent is not None and getattr(sent, "code", None) == 1009:
                raise OpenEnvError(
                    f"{where}: a message over max_bytes={self.spec.max_bytes} (the '#max_bytes=' option)"
                ) from None
            raise OpenEnvError(f"{where}: the connection closed ({_error(exc)})") from None
        if isinstance(raw, bytes):
            raise OpenEnvError(f"{where}: a binary frame of {len(raw)} bytes (the protocol is JSON text)")
        try:
            frame = json.loads(raw)
        except json.JSONDecodeError:
            raise OpenEnvError(f"{where}: a frame that is not JSON: {_short(raw)}") from None
        kind = frame.get("type") if isinstance(frame, dict) else None
        if kind == "error":
            data = frame.get("data") if isinstance(frame.get("data"), dict) else {}
            raise OpenEnvError(
                f"{where}: the server says {_short(data.get('message'))} (code {_short(data.get('code'), 40)})"
            )
        if kind != "observation":
            raise OpenEnvError(f"{where}: expected an observation frame, got {_short(frame)}")
        return frame.get("data")


def _error(exc: BaseException) -> str:
    text = str(exc).splitlines()[0] if str(exc) else ""
    return f"{type(exc).__name__}: {text[:200]}" if text else type(exc).__name__


# ---------------------------------------------------------------------------------------------
# Text <-> environment
# ---------------------------------------------------------------------------------------------
def action_field(schema: Any) -> str:
    """The action's single string field (its `metadata` aside); ValueError naming the fields otherwise."""
    props = schema.get("properties") if isinstance(schema, dict) else None
    if not isinstance(props, dict):
        raise ValueError(f"the action schema has no properties: {_short(schema)}")
    strings = [k for k, v in props.items() if k != "metadata" and isinstance(v, dict) and v.get("type") == "string"]
    required = [k for k in (schema.get("required") or []) if k != "metadata"]
    if len(strings) != 1 or any(k not in strings for k in required):
        fields = sorted(k for k in props if k != "metadata")
        raise ValueError(
            f"the action's fields are {fields}, not one string field: name the one the model's text fills "
            "with '#action=<field>', or map the text yourself with '#action=pkg.module:fn'"
        )
    return strings[0]


def render_observation(observation: dict[str, Any], how: str) -> str:
    """What the model reads: the field `how`, the hook `how` (pkg.module:fn), or by default the
    observation's single string field, else its JSON."""
    if ":" in how:
        text = import_object(how, key=KEY)(observation)
        if not isinstance(text, str):
            raise OpenEnvError(f"observation hook {how} returned {type(text).__name__}, not str")
        return text
    if how:
        if how not in observation:
            raise OpenEnvError(f"the observation has no field {how!r} (fields: {sorted(observation)[:20]})")
        value = observation[how]
        return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)
    strings = [v for v in observation.values() if isinstance(v, str)]
    if len(strings) == 1:
        return strings[0]
    return json.dumps(observation, ensure_ascii=False, sort_keys=True)


def make_action(text: str, observation: dict[str, Any], how: str, completion_id: str) -> dict[str, Any]:
    """The step's action: {how: text} for a field, the hook's dict for pkg.module:fn; its metadata
    gains the completion_id."""
    if ":" in how:
        action = import_object(how, key=KEY)(text, observation)
        if not isinstance(action, dict):
            raise OpenEnvError(f"action hook {how} returned {type(action).__name__}, not a dict")
        action = dict(action)
    else:
        action = {how: text}
    meta = action.get("metadata")
    action["metadata"] = {**(meta if isinstance(meta, dict) else {}), "completion_id": completion_id}
    return action


def fetch_schema(spec: Spec) -> Any:
    """`GET <url>/schema`'s action schema, read up to max_bytes."""
    import httpx

    body = b""
    with httpx.Client(timeout=spec.timeout_s, trust_env=not spec.local) as client:
        with client.stream("GET", spec.url + "/schema") as resp:
            if resp.status_code != 200:
                raise ValueError(f"GET {spec.url}/schema answered {resp.status_code}")
            for chunk in resp.iter_bytes():
                body += chunk
                if len(body) > spec.max_bytes:
                    raise ValueError(f"GET {spec.url}/schema is over max_bytes={spec.max_bytes}")
    try:
        return json.loads(body)["action"]
    except (ValueError, KeyError, TypeError):
        text = _short(body.decode(errors="replace"))
        raise ValueError(f"GET {spec.url}/schema is not an OpenEnv schema: {text}") from None


# ---------------------------------------------------------------------------------------------
# The environment's two functions
# ---------------------------------------------------------------------------------------------
def seeds(seed: int, num_train: int, num_eval: int) -> tuple[list[int], list[int]]:
    """Disjoint train and eval reset seeds, drawn by the run's seed."""
    drawn = random.Random(f"openenv-{seed}").sample(range(SEED_SPACE), num_train + num_eval)
    return drawn[:num_train], drawn[num_train:]


def load_records(spec: str, task: Any, seed: int) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(train, eval): one record per reset seed, its prompt the rendered reset observation. A server
    that cannot be reached or misbehaves, or an action that cannot be derived, is a ConfigError."""
    s = parse_spec(spec)
    if importlib.util.find_spec("websockets") is None:
        raise ConfigError(f"config key '{KEY}': openenv needs the websockets package (pip install -e '.[openenv]')")
    for how in (s.action, s.observation):
        if ":" in how:
            import_object(how, key=KEY)
    train_seeds, eval_seeds = seeds(seed, int(task.num_train), int(task.num_eval))
    try:
        prompts = _run(_reset_all(s, train_seeds + eval_seeds))
    except OpenEnvError as exc:
        raise ConfigError(f"config key '{KEY}': {exc}") from None
    action = s.action
    if not action:
        try:
            action = action_field(fetch_schema(s))
        except Exception as exc:  # noqa: BLE001 - no schema, not OpenEnv's, no single string field
            raise ConfigError(f"config key '{KEY}': the action of {s.url}: {_error(exc)}") from None

    def record(k: int, split: str) -> dict[str, Any]:
        reset = {"seed": k}
        meta = {"openenv": {"reset": reset, "action": action, "split": split}}
        return {"prompt": prompts[k], "answer": json.dumps(reset), "prompt_id": f"openenv-{k}", "meta": meta}

    return [record(k, "train") for k in train_seeds], [record(k, "eval") for k in eval_seeds]


async def _reset_all(spec: Spec, all_seeds: list[int]) -> dict[int, str]:
    prompts: dict[int, str] = {}
    async with Session(spec) as session:
        for k in all_seeds:
            result = await session.reset(seed=k)
            text = render_observation(result.observation, spec.observation)
            if not text.strip():
                raise OpenEnvError(f"{spec.url}: the reset observation of seed {k} renders empty")
            prompts[k] = text
    return prompts


def _run(coro: Any) -> Any:
    """Run `coro` to its end from synchronous code, also under a running event loop."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coro)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        return pool.submit(asyncio.run, coro).result()


async def run_episode(spec: str, task: dict[str, Any], base_url: str, api_key: str) -> dict[str, Any]:
    """One episode of the record's seed against the proxy at base_url: {"reward": the sum of its step
    rewards, "info": {"openenv": {"step_rewards": [one per step], "end": "done" | "turns" | "context"}}}."""
    from openai import AsyncOpenAI, BadRequestError

    s = parse_spec(spec)
    env = (task.get("meta") or {}).get("openenv") or {}
    action_how = s.action or env.get("action")
    if not action_how:
        raise OpenEnvError(f"prompt {task.get('prompt_id')!r} names no action field (meta.openenv.action)")
    rewards: list[float] = []
    end = "turns"
    client = AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0, timeout=max(120.0, s.timeout_s))
    try:
        async with Session(s) as session:
            result = await session.reset(**dict(env.get("reset") or {}))
            messages: list[dict[str, Any]] = [
                {"role": "user", "content": render_observation(result.observation, s.observation)}
            ]
            if result.done:
                end = "done"
            for _ in range(0 if result.done else s.turns):
                try:
                    resp = await client.chat.completions.create(model=MODEL, messages=messages)
                except BadRequestError:  # the episode outgrew the model's context
                    end = "context"
                    break
                text = resp.choices[0].message.content or ""
                result = await session.step(make_action(text, result.observation, action_how, resp.id))
                rewards.append(result.reward or 0.0)
                if result.done:
                    end = "done"
                    break
                messages.append({"role": "assistant", "content": text})
                messages.append({"role": "user", "content": render_observation(result.observation, s.observation)})
    finally:
        await client.close()
    return {"reward": sum(rewards), "info": {"openenv": {"step_rewards": rewards, "end": end}}}


__all__ = ["OpenEnvError", "Session", "Spec", "load_records", "parse_spec", "run_episode"]
