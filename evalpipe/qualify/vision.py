"""Gate `vision`: images in chat `image_url` parts reach the model.

Three PNG images drawn in code (a red disc on white, a blue and yellow checkerboard, a black-to-green gradient;
stdlib zlib, so the bytes never depend on an imaging library) are sent as base64 data URLs, each with the same
text part, greedy, with the first tokens' top logprobs. First a text-only request with the same words (the control:
it shows the server answers chat at all), then image A, A again, B and C, one at a time. The gate passes when:
- every image request is answered (HTTP 200);
- A twice gives the same greedy output (token ids when the server returns them, else the text);
- each pair of different images gives different outputs, or first-token logprobs further apart than the noise
  floor: 4x the distance between A's two replies, and at least 1e-4 (a server that drops the image part answers
  the text alone every time, so its replies to different images agree to the last digit).

A server that refuses the first image with HTTP 400 naming image content and saying it is not taken (a text-only
model: evalpipe's native engine, vLLM serving a text-only model) is skipped with its refusal as the reason. Any other
refusal, a failed control, or a server that accepts images and ignores them, fails. Records show each data URL
shortened; the notes give each PNG's sha256 and the prompt tokens the server counted for every request.
"""

from __future__ import annotations

import base64
import hashlib
import math
import re
import struct
import time
import zlib
from typing import Callable, Optional

from evalpipe.qualify.core import Endpoint, GateResult, Outcome, check, exchange, same_output

PROMPT = "Describe this image in a few words."
MAX_TOKENS = 8
TOP_LOGPROBS = 5
SIDE = 64  # pixels a side
NOISE_FLOOR = 1e-4  # the smallest first-token logprob distance that counts as different images
NOISE_FACTOR = 4.0  # times the distance between two replies to the same image

# The error text the openai client gives: "Error code: 400 - {'error': {'message': '...', ...}}"
SERVER_MESSAGE = re.compile(r"""'message': (['"])(.*?)\1""")
NAMES_IMAGES = re.compile(r"image|multimodal|multi-modal|modalit")
REFUSES = re.compile(r"not supported|unsupported|does not support|not a multimodal|text[ -]only|only text")

Pixel = Callable[[int, int], tuple[int, int, int]]


def png(width: int, height: int, pixel: Pixel) -> bytes:
    """An 8-bit RGB PNG of `pixel(x, y)`."""
    raw = b"".join(b"\x00" + b"".join(bytes(pixel(x, y)) for x in range(width)) for y in range(height))

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(raw, 9)) + chunk(b"IEND", b"")


def _disc(x: int, y: int) -> tuple[int, int, int]:
    inside = (x - SIDE / 2 + 0.5) ** 2 + (y - SIDE / 2 + 0.5) ** 2 <= (SIDE * 0.35) ** 2
    return (220, 30, 30) if inside else (255, 255, 255)


def _checkers(x: int, y: int) -> tuple[int, int, int]:
    return (20, 40, 200) if (x // 8 + y // 8) % 2 else (250, 220, 20)


def _gradient(x: int, y: int) -> tuple[int, int, int]:
    return (0, round(255 * x / (SIDE - 1)), 0)


IMAGES: dict[str, Pixel] = {"A (red disc)": _disc, "B (checkerboard)": _checkers, "C (green gradient)": _gradient}


def data_url(pixel: Pixel) -> str:
    return "data:image/png;base64," + base64.b64encode(png(SIDE, SIDE, pixel)).decode()


def first_token_distance(a: Outcome, b: Outcome) -> Optional[float]:
    """How far apart two replies' first-token distributions are: inf when their top tokens differ, else the largest
    logprob difference over the tokens both top lists name (the chosen token's alone when the server gives no top
    lists). None when either reply has no logprobs."""
    if not (a.top_logprobs and b.top_logprobs and a.top_logprobs[0] and b.top_logprobs[0]):
        if a.logprobs and b.logprobs and a.logprobs[0] is not None and b.logprobs[0] is not None:
            return abs(a.logprobs[0] - b.logprobs[0])
        return None
    ta, tb = a.top_logprobs[0], b.top_logprobs[0]
    if max(ta, key=ta.get) != max(tb, key=tb.get):
        return math.inf
    common = [t for t in ta if t in tb and ta[t] is not None and tb[t] is not None]
    return max((abs(ta[t] - tb[t]) for t in common), default=math.inf)


def server_message(out: Outcome) -> str:
    """The message of a refused request's OpenAI error body, else its whole error text."""
    found = SERVER_MESSAGE.search(out.error or "")
    return found.group(2) if found else (out.error or "")


def refuses_images(out: Outcome) -> bool:
    """A 400 whose message names image content and says it is not taken: how a text-only server refuses images
    (a 400 that says an image could not be read is a failure, not a skip: the gate's PNGs are valid)."""
    text = server_message(out).lower()
    return out.status == 400 and bool(NAMES_IMAGES.search(text)) and bool(REFUSES.search(text))


def _body(ep: Endpoint, url: Optional[str]) -> dict:
    content = (
        PROMPT if url is None else [{"type": "text", "text": PROMPT}, {"type": "image_url", "image_url": {"url": url}}]
    )
    return ep.body(
        messages=[{"role": "user", "content": content}],
        max_tokens=MAX_TOKENS,
        temperature=0.0,
        logprobs=True,
        top_logprobs=TOP_LOGPROBS,
        return_token_ids=True,
    )


def _shown_body(body: dict) -> dict:
    """The body as recorded: an image's data URL shortened to its media type and size (the pixels are in the code)."""
    parts = body["messages"][0]["content"]
    if isinstance(parts, str):
        return body
    shown = [
        {
            "type": "image_url",
            "image_url": {"url": f"{p['image_url']['url'][:22]}... ({len(p['image_url']['url'])} chars)"},
        }
        if p["type"] == "image_url"
        else p
        for p in parts
    ]
    return {**body, "messages": [{"role": "user", "content": shown}]}


async def run(ep: Endpoint) -> GateResult:
    result = GateResult("vision")
    t0 = time.perf_counter()
    body = _body(ep, None)
    control = await ep.send(body, chat=True)
    result.records.append(exchange("control (text only)", "vision", body, control, [control.transport_check()]))
    if not control.ok:
        result.problem = f"the text-only control request failed ({control.error}), so images cannot be tested"
        result.wall_s = time.perf_counter() - t0
        return result
    names = list(IMAGES)
    order = [names[0], names[0], names[1], names[2]]
    replies: list[tuple[str, Outcome]] = []
    for i, name in enumerate(order):
        body = _body(ep, data_url(IMAGES[name]))
        out = await ep.send(body, chat=True)
        if i == 0 and refuses_images(out):
            shown = _shown_body(body)
            result.records.append(exchange(f"image {name}", "vision", shown, out, [out.transport_check()], image=name))
            result.skipped = f"skipped: the server refuses image content: HTTP 400: {server_message(out)}"
            result.wall_s = time.perf_counter() - t0
            return result
        checks = [out.transport_check()]
        if out.ok:
            checks += _compare(name, out, replies)
        rid = f"image {name}" + (" again" if name in dict(replies) else "")
        result.records.append(exchange(rid, "vision", _shown_body(body), out, checks, image=name))
        if out.ok:
            replies.append((name, out))
    result.notes = {
        "images": {
            name: {"size": f"{SIDE}x{SIDE} PNG", "sha256": hashlib.sha256(png(SIDE, SIDE, IMAGES[name])).hexdigest()}
            for name in names
        },
        "prompt_tokens": {
            "control": (control.usage or {}).get("prompt_tokens"),
            **{r["id"]: (r.get("usage") or {}).get("prompt_tokens") for r in result.records[1:]},
        },
        "noise_floor": _noise(replies),
    }
    result.wall_s = time.perf_counter() - t0
    return result


def _noise(replies: list[tuple[str, Outcome]]) -> float:
    """The logprob distance below which two replies count as the same: NOISE_FACTOR x that of A's two replies."""
    same = [out for name, out in replies if name == replies[0][0]] if replies else []
    d = first_token_distance(same[0], same[1]) if len(same) == 2 else None
    return max(NOISE_FLOOR, NOISE_FACTOR * d) if d is not None and math.isfinite(d) else NOISE_FLOOR


def _compare(name: str, out: Outcome, earlier: list[tuple[str, Outcome]]) -> list[dict]:
    """This reply against every earlier one: equal to the same image's, apart from every other image's."""
    checks = []
    firsts: dict[str, Outcome] = {}
    for other, prev in earlier:
        firsts.setdefault(other, prev)
    for other, prev in firsts.items():
        if other == name:
            ok, detail = same_output(prev, out)
            d = first_token_distance(prev, out)
            checks.append(
                check("same image, same output", ok, detail + ("" if d is None else f"; first-token distance {d:.3g}"))
            )
            continue
        same, _ = same_output(prev, out)
        d = first_token_distance(prev, out)
        floor = _noise(earlier + [(name, out)])
        if not same:
            ok, detail = True, f"outputs differ ({prev.text[:40]!r} vs {out.text[:40]!r})"
        elif d is None:
            ok, detail = False, f"same output as image {other} and no logprobs to tell them apart: the image is ignored"
        else:
            ok = d > floor
            detail = f"same output as image {other}; first-token logprobs {d:.3g} apart " + (
                f"(noise floor {floor:.3g})" if ok else f"(not above the noise floor {floor:.3g}): the image is ignored"
            )
        checks.append(check(f"differs from image {other}", ok, detail))
    return checks
