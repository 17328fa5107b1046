#!/usr/bin/env python3
"""Independent reference for kvsight's tokenizer: token ids computed the way vLLM computes them,
with Python `tokenizers` and `jinja2` configured as transformers configures them.

Usage: check_tokenizer.py [--transformers] TOKENIZER_DIR [CASES_JSON [CHAT_TEMPLATE_FILE]]

TOKENIZER_DIR holds tokenizer.json and (optionally) tokenizer_config.json. CASES_JSON (a file, or
stdin when absent or "-") is a JSON list of cases, each either
  {"prompt": "..."}                                      completion: add_special_tokens=True
  {"messages": [...], "add_generation_prompt": true}     chat: render, then add_special_tokens=False
  (optional "tools": [...], "continue_final_message": true)
With --transformers the ids come from transformers' AutoTokenizer and apply_chat_template
(vLLM's own path; vLLM pins transformers < 5) instead of the re-implementation below.
CHAT_TEMPLATE_FILE replaces the config's chat template (like vLLM's --chat-template).
Prints a JSON list with one {"text": rendered-or-prompt, "ids": [...]} per case.
"""

import json
import sys
from datetime import datetime
from pathlib import Path

import jinja2
import jinja2.ext
import jinja2.sandbox
from tokenizers import AddedToken, Tokenizer, processors

SPECIAL_TOKEN_KEYS = (
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
)


def token_content(value):
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"]
    return None


def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    # transformers' own tojson: json.dumps, not jinja2's HTML-safe filter.
    return json.dumps(
        x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)


def strftime_now(fmt):
    return datetime.now().strftime(fmt)


def register_config_tokens(tokenizer, config, special):
    """transformers adds added_tokens_decoder entries and special tokens tokenizer.json lacks."""
    known = {t.content for t in tokenizer.get_added_tokens_decoder().values()}
    to_add = []
    decoder = config.get("added_tokens_decoder") or {}
    for _, entry in sorted(((int(k), v) for k, v in decoder.items()), key=lambda kv: kv[0]):
        if entry["content"] in known:
            continue
        known.add(entry["content"])
        is_special = bool(entry.get("special", False))
        to_add.append(
            AddedToken(
                entry["content"],
                single_word=bool(entry.get("single_word", False)),
                lstrip=bool(entry.get("lstrip", False)),
                rstrip=bool(entry.get("rstrip", False)),
                normalized=bool(entry.get("normalized", not is_special)),
                special=is_special,
            )
        )
    named = [v for k, v in special.items() if k != "additional_special_tokens"]
    for content in named + list(special.get("additional_special_tokens", [])):
        if content not in known:
            known.add(content)
            to_add.append(AddedToken(content, special=True, normalized=False))
    if to_add:
        tokenizer.add_tokens(to_add)


REBUILDING_CLASSES = {
    "LlamaTokenizer": (True, False),
    "CodeLlamaTokenizer": (True, False),
    "GemmaTokenizer": (True, False),
    "CohereTokenizer": (True, False),
    "GPTNeoXTokenizer": (False, False),
}


def apply_bos_eos_flags(tokenizer, config, special):
    """transformers 4.x: Llama-family classes rebuild the post-processor from the flags."""
    cls = config.get("tokenizer_class") or ""
    cls = cls[: -len("Fast")] if cls.endswith("Fast") else cls
    if cls not in REBUILDING_CLASSES:
        return
    default_bos, default_eos = REBUILDING_CLASSES[cls]
    bos = special.get("bos_token") if config.get("add_bos_token", default_bos) else None
    eos = special.get("eos_token") if config.get("add_eos_token", default_eos) else None
    single = " ".join(p for p in (bos and f"{bos}:0", "$A:0", eos and f"{eos}:0") if p)
    pair = " ".join(p for p in (single, bos and f"{bos}:1", "$B:1", eos and f"{eos}:1") if p)
    specials = [(t, tokenizer.token_to_id(t)) for t in (bos, eos) if t]
    tokenizer.post_processor = processors.TemplateProcessing(
        single=single, pair=pair, special_tokens=specials
    )


def load_template(config):
    template = config.get("chat_template")
    if isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template}
        template = named.get("default")
    return template


def conversation(messages):
    """vLLM's string content format: text parts joined with newlines."""
    out = []
    for message in messages:
        content = message.get("content")
        if content is None:
            parts = []
        elif isinstance(content, str):
            parts = [content]
        else:
            parts = []
            for part in content:
                if isinstance(part, str):
                    parts.append(part)
                    continue
                key = {
                    "text": "text",
                    "input_text": "text",
                    "output_text": "text",
                    "refusal": "refusal",
                    "thinking": "thinking",
                }[part["type"]]
                if part.get(key) is not None:
                    parts.append(part[key])
        msg = {"role": message["role"], "content": "\n".join(parts)}
        if message["role"] == "assistant":
            calls = message.get("tool_calls")
            if isinstance(calls, list) and calls:
                calls = json.loads(json.dumps(calls))
                for call in calls:
                    args = call["function"].get("arguments")
                    if isinstance(args, str):
                        try:
                            call["function"]["arguments"] = json.loads(args)
                        except json.JSONDecodeError:
                            call["function"]["arguments"] = {}
                    elif not isinstance(args, (dict, list)):
                        call["function"]["arguments"] = {}
                msg["tool_calls"] = calls
            if message.get("reasoning") is not None:
                msg["reasoning"] = message["reasoning"]
                msg["reasoning_content"] = message["reasoning"]
        elif message["role"] == "tool" and "tool_call_id" in message:
            msg["tool_call_id"] = message["tool_call_id"]
        if isinstance(message.get("name"), str):
            msg["name"] = message["name"]
        out.append(msg)
    return out


def cut_after_final_message(text, final):
    """transformers' continue_final_message: cut after the last message's content."""
    if isinstance(final, list):
        final = next(p["text"] for p in reversed(final) if "text" in p)
    at = text.rindex(final.strip())
    if text[at : at + len(final.lstrip())] == final:
        return text[: at + len(final.lstrip())]
    return text[: at + len(final.strip())]


def with_transformers(directory, cases, override):
    """vLLM's own path: AutoTokenizer + apply_chat_template (after vLLM's message parsing)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(directory))
    results = []
    for case in cases:
        if "prompt" in case:
            text = case["prompt"]
            ids = tok.encode(text, add_special_tokens=True)
        else:
            kwargs = {}
            if case.get("continue_final_message"):
                kwargs["continue_final_message"] = True
            text = tok.apply_chat_template(
                conversation(case["messages"]),
                tools=case.get("tools"),
                chat_template=override,
                add_generation_prompt=bool(case.get("add_generation_prompt", False)),
                tokenize=False,
                **kwargs,
            )
            ids = tok.encode(text, add_special_tokens=False)
        results.append({"text": text, "ids": list(ids)})
    return results


def main(argv):
    use_transformers = "--transformers" in argv
    argv = [a for a in argv if a != "--transformers"]
    if len(argv) < 2:
        print(__doc__, file=sys.stderr)
        return 64
    directory = Path(argv[1])
    source = argv[2] if len(argv) > 2 else "-"
    cases = json.load(sys.stdin if source == "-" else open(source, encoding="utf-8"))
    override = None
    if len(argv) > 3:
        override = Path(argv[3]).read_text(encoding="utf-8")
    if use_transformers:
        json.dump(with_transformers(directory, cases, override), sys.stdout, ensure_ascii=False)
        sys.stdout.write("\n")
        return 0

    tokenizer = Tokenizer.from_file(str(directory / "tokenizer.json"))
    # transformers switches truncation and padding off for calls that do not ask for them.
    tokenizer.no_truncation()
    tokenizer.no_padding()
    config_path = directory / "tokenizer_config.json"
    config = json.loads(config_path.read_text(encoding="utf-8")) if config_path.exists() else {}
    special = {}
    for key in SPECIAL_TOKEN_KEYS:
        value = token_content(config.get(key))
        if value is not None:
            special[key] = value
    extra = config.get("additional_special_tokens")
    if isinstance(extra, list) and extra:
        special["additional_special_tokens"] = [token_content(t) for t in extra]
    register_config_tokens(tokenizer, config, special)
    apply_bos_eos_flags(tokenizer, config, special)

    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    source_template = override if override is not None else load_template(config)
    template = env.from_string(source_template) if source_template else None

    results = []
    for case in cases:
        if "prompt" in case:
            text = case["prompt"]
            ids = tokenizer.encode(text, add_special_tokens=True).ids
        else:
            if template is None:
                raise SystemExit("tokenizer has no chat template")
            text = template.render(
                messages=conversation(case["messages"]),
                tools=case.get("tools"),
                documents=None,
                add_generation_prompt=bool(case.get("add_generation_prompt", False)),
                **special,
            )
            if case.get("continue_final_message"):
                text = cut_after_final_message(text, conversation(case["messages"])[-1]["content"])
            ids = tokenizer.encode(text, add_special_tokens=False).ids
        results.append({"text": text, "ids": ids})
    json.dump(results, sys.stdout, ensure_ascii=False)
    sys.stdout.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
