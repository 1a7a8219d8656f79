"""Generate text from the command line, streaming tokens as they come.

    python -m engine.generate --prompt "What is the capital of France?"
    python -m engine.generate --raw --prompt "Once upon a time" --temperature 0.8 --seed 1

The prompt goes through the model's chat template unless --raw is given (or the model
has none). Uses the default model unless --model names an HF folder.
"""
from __future__ import annotations

import argparse
import sys
import time

from engine import EngineConfig, EngineError, LLMEngine, SamplingParams


def build_prompt(engine: LLMEngine, prompt: str, system: str | None, raw: bool) -> str:
    tokenizer = engine.tokenizer
    if raw or getattr(tokenizer, "chat_template", None) is None:
        return prompt
    messages = [{"role": "system", "content": system}] if system else []
    messages.append({"role": "user", "content": prompt})
    return tokenizer.apply_chat_template(messages, add_generation_prompt=True)


def stream(engine: LLMEngine, prompt: str, params: SamplingParams) -> tuple[int, str | None]:
    """Run one request, writing its text to stdout as it grows. Returns
    (number of output tokens, finish reason)."""
    engine.add_request("cli", prompt, params)
    num_tokens, reason = 0, None
    while engine.has_unfinished_requests():
        for out in engine.step():
            sys.stdout.write(out.text_delta)
            sys.stdout.flush()
            num_tokens, reason = len(out.output_token_ids), out.finish_reason
    sys.stdout.write("\n")
    return num_tokens, reason


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="Stream a completion from kvops")
    p.add_argument("--prompt", required=True)
    p.add_argument("--model", default=None, help="HF folder (default: the converted default model)")
    p.add_argument("--system", default=None, help="system message for the chat template")
    p.add_argument("--raw", action="store_true", help="send the prompt as is, no chat template")
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=None)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    args = p.parse_args(argv)
    try:
        engine = LLMEngine(EngineConfig(model=args.model, device=args.device, dtype=args.dtype))
        params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                                top_p=args.top_p, top_k=args.top_k, seed=args.seed,
                                stop=args.stop)
        prompt = build_prompt(engine, args.prompt, args.system, args.raw)
        start = time.perf_counter()
        num_tokens, reason = stream(engine, prompt, params)
    except EngineError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    seconds = time.perf_counter() - start
    print(f"[{num_tokens} tokens in {seconds:.2f} s, {num_tokens / seconds:.1f} tok/s, "
          f"finish: {reason}]", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
