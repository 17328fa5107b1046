//! The real Phi-3-mini tokenizer (from `../shared/fixtures`, read at test time) must give the ids
//! vLLM gives; and the template/tokenizer error paths are typed errors, never panics.

mod common;

use common::{NASTY, assert_fast_equals_reference};
use kvsight_tokenizer::{ChatExtras, ChatMessage, ContentFormat, ModelTokenizer, TokenizerError};

/// Phi-3-mini's tokenizer files, under `../shared`.
const PHI3_JSON: &str = "fixtures/tokenizers/phi-3-mini/tokenizer.json";

/// The Phi-3 tokenizer, or `None` (after printing the skip line) when the fixture is absent.
fn phi3(test: &str) -> Option<ModelTokenizer> {
    let tokenizer_json = kvsight_harness::fixture_or_skip(test, PHI3_JSON)?;
    let json = std::fs::read(&tokenizer_json).expect("read tokenizer.json");
    let config =
        std::fs::read(tokenizer_json.with_file_name("tokenizer_config.json")).expect("read config");
    Some(ModelTokenizer::from_bytes(&json, Some(&config)).expect("phi-3 tokenizer"))
}

fn capital_of_france() -> Vec<ChatMessage> {
    vec![
        ChatMessage::new("user", "What is the capital of France?"),
        ChatMessage::new("assistant", "The capital of France is Paris."),
    ]
}

#[test]
fn phi3_chat_gives_the_19_ids_from_source_md() {
    let Some(tok) = phi3("phi3_chat_gives_the_19_ids_from_source_md") else {
        return;
    };
    let rendered = tok
        .render_chat(&capital_of_france(), true, &ChatExtras::default())
        .expect("render");
    assert_eq!(
        rendered,
        "<|user|>\nWhat is the capital of France?<|end|>\n<|assistant|>\n\
         The capital of France is Paris.<|end|>\n<|assistant|>\n"
    );
    let ids = tok
        .encode_chat(&capital_of_france(), true, &ChatExtras::default())
        .expect("encode");
    assert_eq!(
        ids,
        [
            32010, 1724, 338, 278, 7483, 310, 3444, 29973, 32007, 32001, 450, 7483, 310, 3444, 338,
            3681, 29889, 32007, 32001
        ]
    );
}

#[test]
fn phi3_chat_without_generation_prompt_ends_with_eos() {
    let Some(tok) = phi3("phi3_chat_without_generation_prompt_ends_with_eos") else {
        return;
    };
    let ids = tok
        .encode_chat(&capital_of_france(), false, &ChatExtras::default())
        .expect("encode");
    assert_eq!(
        ids.last(),
        Some(&32000),
        "eos_token <|endoftext|> from the config"
    );
    assert_eq!(ids.len(), 19);
    assert_eq!(tok.special_token("eos_token"), Some("<|endoftext|>"));
    assert_eq!(tok.special_token("bos_token"), Some("<s>"));
}

#[test]
fn phi3_completion_adds_no_bos() {
    let Some(tok) = phi3("phi3_completion_adds_no_bos") else {
        return;
    };
    // Phi-3's post-processor adds nothing, so add_special_tokens=true gives the bare ids (the
    // same ids the chat vector has for this sentence); the normalizer's "▁" prefix applies.
    let ids = tok
        .encode_completion("What is the capital of France?")
        .expect("encode");
    assert_eq!(ids, [1724, 338, 278, 7483, 310, 3444, 29973]);
    assert_eq!(
        tok.decode(&ids, true).expect("decode"),
        "What is the capital of France?"
    );
    // Special tokens written in a completion prompt are matched as tokens, as in vLLM.
    let ids = tok
        .encode_completion("<|user|>\nHi<|end|>")
        .expect("encode");
    assert_eq!(ids.first(), Some(&32010));
    assert!(ids.contains(&32007));
}

#[test]
fn phi3_digest_identifies_the_inputs() {
    let Some(tok) = phi3("phi3_digest_identifies_the_inputs") else {
        return;
    };
    let again = phi3("phi3_digest_identifies_the_inputs").expect("present");
    assert_eq!(tok.digest(), again.digest());
    assert_eq!(tok.digest_hex().len(), 64);
    let path = kvsight_harness::shared_fixture(PHI3_JSON);
    let json = std::fs::read(&path).expect("read");
    let config = std::fs::read(path.with_file_name("tokenizer_config.json")).expect("read");
    assert_eq!(
        tok.digest(),
        kvsight_tokenizer::tokenizer_digest(&json, Some(&config), None),
        "the files alone give the same digest"
    );
    let overridden = again.with_chat_template("{{ messages[0]['content'] }}");
    assert_ne!(tok.digest(), overridden.digest());
    assert_eq!(
        overridden
            .render_chat(&capital_of_france(), false, &ChatExtras::default())
            .expect("render"),
        "What is the capital of France?"
    );
}

/// A minimal tokenizer.json (word-level, whitespace) so these tests need no fixture.
fn tiny_tokenizer_json() -> Vec<u8> {
    word_level_json(
        serde_json::json!({"[UNK]": 0, "hello": 1, "world": 2}),
        serde_json::json!([]),
        serde_json::Value::Null,
    )
}

/// A word-level tokenizer.json over `vocab` (whitespace pre-tokenizer, `[UNK]` unknown) with
/// these added tokens and post-processor.
fn word_level_json(
    vocab: serde_json::Value,
    added_tokens: serde_json::Value,
    post_processor: serde_json::Value,
) -> Vec<u8> {
    serde_json::to_vec(&serde_json::json!({
        "version": "1.0",
        "truncation": null,
        "padding": null,
        "added_tokens": added_tokens,
        "normalizer": null,
        "pre_tokenizer": {"type": "Whitespace"},
        "post_processor": post_processor,
        "decoder": null,
        "model": {
            "type": "WordLevel",
            "vocab": vocab,
            "unk_token": "[UNK]"
        }
    }))
    .expect("json")
}

fn tiny(config: serde_json::Value) -> Result<ModelTokenizer, TokenizerError> {
    let config = serde_json::to_vec(&config).expect("json");
    ModelTokenizer::from_bytes(&tiny_tokenizer_json(), Some(&config))
}

#[test]
fn broken_inputs_are_typed_errors() {
    assert!(matches!(
        ModelTokenizer::from_bytes(b"{not json", None),
        Err(TokenizerError::InvalidTokenizer(_))
    ));
    assert!(matches!(
        ModelTokenizer::from_bytes(&tiny_tokenizer_json(), Some(b"[1, 2]")),
        Err(TokenizerError::InvalidConfig(_))
    ));
    assert!(matches!(
        tiny(serde_json::json!({"chat_template": 7})),
        Err(TokenizerError::InvalidConfig(_))
    ));

    let no_template = tiny(serde_json::json!({})).expect("tokenizer without template");
    assert_eq!(
        no_template
            .encode_completion("hello world")
            .expect("encode"),
        [1, 2]
    );
    let msgs = [ChatMessage::new("user", "hello")];
    let extras = ChatExtras::default();
    assert_eq!(
        no_template.render_chat(&msgs, true, &extras),
        Err(TokenizerError::NoChatTemplate)
    );

    // A template that does not compile still leaves completions working.
    let broken = tiny(serde_json::json!({"chat_template": "{% for m in messages %}{{ m"}))
        .expect("tokenizer with a broken template");
    assert_eq!(broken.encode_completion("world").expect("encode"), [2]);
    assert!(matches!(
        broken.render_chat(&msgs, true, &extras),
        Err(TokenizerError::TemplateSyntax(_))
    ));

    let raises = no_template
        .clone()
        .with_chat_template("{{ raise_exception('roles must alternate') }}");
    assert_eq!(
        raises.render_chat(&msgs, true, &extras),
        Err(TokenizerError::TemplateRaised(
            "roles must alternate".to_owned()
        ))
    );

    let bad_op = no_template
        .clone()
        .with_chat_template("{{ messages[0].content.nope.deeper }}");
    assert!(matches!(
        bad_op.render_chat(&msgs, true, &extras),
        Err(TokenizerError::TemplateRender(_))
    ));
}

#[test]
fn template_environment_matches_transformers() {
    let tok = tiny(serde_json::json!({
        "bos_token": {"content": "<s>", "lstrip": false},
        "eos_token": "</s>",
        "additional_special_tokens": ["<x>"],
    }))
    .expect("tokenizer");
    let render = |template: &str, extras: &ChatExtras| {
        tok.clone().with_chat_template(template).render_chat(
            &[ChatMessage::new("user", " hi ")],
            true,
            extras,
        )
    };
    let none = ChatExtras::default();

    // trim_blocks + lstrip_blocks: block lines leave no whitespace behind.
    assert_eq!(
        render(
            "{% for m in messages %}\n    {% if m.role == 'user' %}\n[{{ m.content }}]\n    {% endif %}\n{% endfor %}",
            &none
        )
        .expect("render"),
        "[ hi ]\n"
    );
    // Special tokens (string or AddedToken form) are in the context.
    assert_eq!(
        render(
            "{{ bos_token }}|{{ eos_token }}|{{ additional_special_tokens[0] }}",
            &none
        )
        .expect("render"),
        "<s>|</s>|<x>"
    );
    // Python string methods and Python-style printing of booleans and None.
    assert_eq!(
        render(
            "{{ messages[0].content.strip().upper() }} {{ add_generation_prompt }} {{ tools }}",
            &none
        )
        .expect("render"),
        "HI True None"
    );
    // Lists and dicts print as Python reprs.
    assert_eq!(
        render(
            r#"{{ ['a', "it's", 1, none, true, 2.5, 'x\ny'] }} {{ {'k': [1], 'b': 'q"'} }} {{ 4 / 2 }} {{ messages }}"#,
            &none
        )
        .expect("render"),
        r#"['a', "it's", 1, None, True, 2.5, 'x\ny'] {'k': [1], 'b': 'q"'} 2.0 [{'role': 'user', 'content': ' hi '}]"#
    );
    // Loop controls.
    assert_eq!(
        render(
            "{% for i in range(5) %}{% if i == 1 %}{% continue %}{% endif %}{% if i == 3 %}{% break %}{% endif %}{{ i }}{% endfor %}",
            &none
        )
        .expect("render"),
        "02"
    );
    // tojson as Python's json.dumps: spaces after separators, key order kept, no HTML escaping,
    // non-ASCII kept; indent switches to newlines.
    let mut extras = ChatExtras::default();
    extras.template_kwargs.insert(
        "x".to_owned(),
        serde_json::json!({"b": 1, "a": ["é<&>'", 2.5, true, null]}),
    );
    assert_eq!(
        render("{{ x | tojson }}", &extras).expect("render"),
        r#"{"b": 1, "a": ["é<&>'", 2.5, true, null]}"#
    );
    assert_eq!(
        render("{{ x | tojson(indent=2) }}", &extras).expect("render"),
        "{\n  \"b\": 1,\n  \"a\": [\n    \"é<&>'\",\n    2.5,\n    true,\n    null\n  ]\n}"
    );
    // Tools reach the template; kwargs can add variables.
    extras.tools = Some(vec![serde_json::json!({"type": "function"})]);
    extras
        .template_kwargs
        .insert("enable_thinking".to_owned(), serde_json::json!(false));
    assert_eq!(
        render("{{ tools | length }} {{ enable_thinking }}", &extras).expect("render"),
        "1 False"
    );
}

#[test]
fn content_parts_follow_the_template_content_format() {
    let tok = tiny(serde_json::json!({})).expect("tokenizer");
    let parts: ChatMessage = serde_json::from_value(serde_json::json!({
        "role": "user",
        "content": [{"type": "text", "text": "a"}, "b", {"type": "text", "text": null}]
    }))
    .expect("parse");
    let string_template = "{% for m in messages %}<{{ m['content'] }}>{% endfor %}";
    let openai_template =
        "{% for m in messages %}{% for p in m['content'] %}[{{ p.text }}]{% endfor %}{% endfor %}";
    let extras = ChatExtras::default();
    let string = tok.clone().with_chat_template(string_template);
    assert_eq!(
        string
            .render_chat(std::slice::from_ref(&parts), false, &extras)
            .expect("render"),
        "<a\nb>"
    );
    let openai = tok.clone().with_chat_template(openai_template);
    assert_eq!(
        openai
            .render_chat(std::slice::from_ref(&parts), false, &extras)
            .expect("render"),
        "[a][b]"
    );
    // Plain string content becomes one text part for an openai-format template.
    assert_eq!(
        openai
            .render_chat(&[ChatMessage::new("user", "c")], false, &extras)
            .expect("render"),
        "[c]"
    );
    // The format can be forced, as with vLLM's --chat-template-content-format.
    let forced = tok
        .with_chat_template(string_template)
        .with_content_format(ContentFormat::OpenAi);
    assert!(
        forced
            .render_chat(std::slice::from_ref(&parts), false, &extras)
            .expect("render")
            .starts_with("<[")
    );
}

#[test]
fn tool_call_arguments_are_parsed_like_vllm() {
    let tok = tiny(serde_json::json!({}))
        .expect("tokenizer")
        .with_chat_template(
            "{% for m in messages %}{% for c in m.tool_calls or [] %}{{ c.function.arguments.city }}{{ c.function.arguments | tojson }}{% endfor %}{% endfor %}",
        );
    let msg: ChatMessage = serde_json::from_value(serde_json::json!({
        "role": "assistant",
        "content": null,
        "tool_calls": [
            {"id": "1", "type": "function", "function": {"name": "w", "arguments": "{\"city\": \"Oslo\"}"}},
            {"id": "2", "type": "function", "function": {"name": "w", "arguments": "not json"}}
        ]
    }))
    .expect("parse");
    assert_eq!(
        tok.render_chat(&[msg], false, &ChatExtras::default())
            .expect("render"),
        "Oslo{\"city\": \"Oslo\"}{}"
    );
}

/// A word-level tokenizer with `<s>`/`</s>` and the given post-processor.
fn with_post_processor(
    post_processor: serde_json::Value,
    config: serde_json::Value,
) -> ModelTokenizer {
    let json = word_level_json(
        serde_json::json!({"[UNK]": 0, "hello": 1, "world": 2, "<s>": 3, "</s>": 4}),
        serde_json::json!([
            {"id": 3, "content": "<s>", "single_word": false, "lstrip": false, "rstrip": false, "normalized": false, "special": true},
            {"id": 4, "content": "</s>", "single_word": false, "lstrip": false, "rstrip": false, "normalized": false, "special": true}
        ]),
        post_processor,
    );
    let config = serde_json::to_vec(&config).expect("json");
    ModelTokenizer::from_bytes(&json, Some(&config)).expect("tokenizer")
}

#[test]
fn llama_family_flags_decide_the_completion_specials() {
    // transformers 4.x (what vLLM pins) rebuilds the post-processor for Llama-family classes
    // from add_bos_token (default true) / add_eos_token (default false), and only for them.
    let bos_processor = serde_json::json!({
        "type": "TemplateProcessing",
        "single": [{"SpecialToken": {"id": "<s>", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
        "pair": [{"SpecialToken": {"id": "<s>", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}, {"Sequence": {"id": "B", "type_id": 1}}],
        "special_tokens": {"<s>": {"id": "<s>", "ids": [3], "tokens": ["<s>"]}}
    });
    let config = |extra: serde_json::Value| {
        let mut config = serde_json::json!({"bos_token": "<s>", "eos_token": "</s>"});
        for (k, v) in extra.as_object().expect("object") {
            config[k] = v.clone();
        }
        config
    };
    let ids = |post: &serde_json::Value, extra: serde_json::Value| {
        with_post_processor(post.clone(), config(extra))
            .encode_completion("hello world")
            .expect("encode")
    };
    let null = serde_json::Value::Null;

    // Not a rebuilding class: tokenizer.json decides, flags are ignored.
    assert_eq!(ids(&bos_processor, serde_json::json!({})), [3, 1, 2]);
    assert_eq!(ids(&null, serde_json::json!({})), [1, 2]);
    assert_eq!(
        ids(
            &null,
            serde_json::json!({"tokenizer_class": "PreTrainedTokenizerFast", "add_bos_token": true})
        ),
        [1, 2]
    );
    // Llama: BOS by default even when tokenizer.json adds none ...
    assert_eq!(
        ids(
            &null,
            serde_json::json!({"tokenizer_class": "LlamaTokenizer"})
        ),
        [3, 1, 2]
    );
    // ... none when the config says so, whatever tokenizer.json says ...
    assert_eq!(
        ids(
            &bos_processor,
            serde_json::json!({"tokenizer_class": "LlamaTokenizerFast", "add_bos_token": false})
        ),
        [1, 2]
    );
    // ... and EOS too when asked.
    assert_eq!(
        ids(
            &null,
            serde_json::json!({"tokenizer_class": "GemmaTokenizer", "add_eos_token": true})
        ),
        [3, 1, 2, 4]
    );
    // GPT-NeoX defaults to neither.
    assert_eq!(
        ids(
            &bos_processor,
            serde_json::json!({"tokenizer_class": "GPTNeoXTokenizerFast"})
        ),
        [1, 2]
    );
    // Chat never adds them: the template writes what it wants.
    let tok = with_post_processor(
        null.clone(),
        config(serde_json::json!({"tokenizer_class": "LlamaTokenizer"})),
    );
    assert_eq!(tok.encode("hello world", false).expect("encode"), [1, 2]);
}

#[test]
fn config_special_tokens_become_atomic_as_in_transformers() {
    // "<x>" is in the vocabulary but not an added token; the Whitespace pre-tokenizer would
    // split it into "<", "x", ">" — unless the config's special tokens are registered.
    let json = word_level_json(
        serde_json::json!({"[UNK]": 0, "hello": 1, "<x>": 2, "<": 3, ">": 4}),
        serde_json::json!([]),
        serde_json::Value::Null,
    );
    let plain = ModelTokenizer::from_bytes(&json, None).expect("tokenizer");
    assert_eq!(
        plain.encode("hello<x>", false).expect("encode"),
        [1, 3, 0, 4]
    );

    let config = serde_json::to_vec(&serde_json::json!({
        "additional_special_tokens": ["<x>"],
        "eos_token": "<new>",
        "added_tokens_decoder": {"9": {"content": "<tool>", "special": true}}
    }))
    .expect("json");
    let tok = ModelTokenizer::from_bytes(&json, Some(&config)).expect("tokenizer");
    assert_eq!(tok.encode("hello<x>", false).expect("encode"), [1, 2]);
    // Tokens the vocabulary lacks get new ids after it, config decoder entries first.
    assert_eq!(tok.token_to_id("<tool>"), Some(5));
    assert_eq!(tok.token_to_id("<new>"), Some(6));
    assert_eq!(tok.encode("<new>hello", false).expect("encode"), [6, 1]);
}

#[test]
fn continue_final_message_cuts_after_the_last_content() {
    let tok = tiny(serde_json::json!({}))
        .expect("tokenizer")
        .with_chat_template(
            "{% for m in messages %}<{{ m.role }}>{{ m.content | trim }}</end>{% endfor %}{% if add_generation_prompt %}<assistant>{% endif %}",
        );
    let extras = ChatExtras {
        continue_final_message: true,
        ..ChatExtras::default()
    };
    let msgs = |last: &str| {
        vec![
            ChatMessage::new("user", "hi"),
            ChatMessage::new("assistant", last),
        ]
    };
    assert_eq!(
        tok.render_chat(&msgs("The answer is"), false, &extras)
            .expect("render"),
        "<user>hi</end><assistant>The answer is"
    );
    // The template trimmed the trailing space, so the cut follows the stripped content.
    assert_eq!(
        tok.render_chat(&msgs("The answer is "), false, &extras)
            .expect("render"),
        "<user>hi</end><assistant>The answer is"
    );
    assert!(matches!(
        tok.render_chat(&msgs("x"), true, &extras),
        Err(TokenizerError::InvalidRequest(_))
    ));
    let hidden = tok
        .clone()
        .with_chat_template("{% for m in messages %}<{{ m.role }}>{% endfor %}");
    assert!(matches!(
        hidden.render_chat(&msgs("gone"), false, &extras),
        Err(TokenizerError::InvalidMessage { index: 1, .. })
    ));
}

#[test]
fn phi3_takes_the_sentencepiece_fast_path_with_the_full_pipelines_ids() {
    let Some(tok) = phi3("phi3_takes_the_sentencepiece_fast_path_with_the_full_pipelines_ids")
    else {
        return;
    };
    assert_eq!(tok.fast_path(), Some("sentencepiece"));
    let fixed = [
        "",
        " ",
        "   ",
        "Hello",
        " Hello",
        "Hello ",
        "  Hello  world  ",
        "\tindented\n\tcode\n",
        "line one\n\nline two\r\n",
        "▁Hello▁ ▁world",
        "naïve café e\u{301}te",
        "中文 日本語 한국어",
        "emoji 🙂👍🏽 👨‍👩‍👧",
        "\u{0}\u{7f}\u{feff}\u{e000}\u{10fffd}",
        "<|user|>\nHi<|end|>\n<|assistant|>\n",
        "<|user|> \n  Hi  <|end|>  </s>  <s> x",
        "text</s>text<s>text",
        "<unk><|endoftext|>",
        "<|notatoken|> <|user",
    ];
    for text in fixed {
        assert_fast_equals_reference(&tok, text);
    }
    // Longer than the BPE cache's 256-byte words, with and without spaces to cut at.
    assert_fast_equals_reference(&tok, &"中文字符".repeat(200));
    assert_fast_equals_reference(&tok, &"word ".repeat(300));
    let all: String = NASTY.concat();
    assert_fast_equals_reference(&tok, &all.repeat(5));
}

#[test]
fn phi3_fast_path_equals_the_full_pipeline_on_a_long_chat() {
    let Some(tok) = phi3("phi3_fast_path_equals_the_full_pipeline_on_a_long_chat") else {
        return;
    };
    let paragraph = "The capital of France is Paris.  It has   many museums;\tthe Louvre \
                     is one.\nQ: 2+2? A: 4 — café, 東京, 🙂.\n\n";
    let messages = vec![
        ChatMessage::new("system", paragraph.repeat(20)),
        ChatMessage::new("user", paragraph.repeat(15)),
        ChatMessage::new("assistant", " leading and trailing spaces "),
        ChatMessage::new("user", "<|end|> written by the user </s>"),
    ];
    let prompt = tok
        .render_chat(&messages, true, &ChatExtras::default())
        .expect("render");
    let ids = tok
        .encode_chat(&messages, true, &ChatExtras::default())
        .expect("encode");
    assert!(ids.len() > 1000, "a long chat: {} ids", ids.len());
    assert_eq!(
        ids,
        tok.encode_reference(&prompt, false).expect("reference")
    );
}

mod phi3_proptest {
    use proptest::prelude::*;

    use super::*;

    fn nasty_text() -> impl Strategy<Value = String> {
        prop::collection::vec(prop::sample::select(NASTY), 0..40).prop_map(|f| f.concat())
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(256))]

        #[test]
        fn phi3_fast_path_equals_the_full_pipeline(
            text in prop_oneof![nasty_text(), any::<String>()],
        ) {
            thread_local! {
                static TOK: Option<ModelTokenizer> =
                    phi3("phi3_fast_path_equals_the_full_pipeline");
            }
            TOK.with(|tok| {
                if let Some(tok) = tok {
                    for add_special_tokens in [false, true] {
                        prop_assert_eq!(
                            tok.encode(&text, add_special_tokens).expect("fast"),
                            tok.encode_reference(&text, add_special_tokens).expect("reference")
                        );
                    }
                }
                Ok(())
            })?;
        }
    }
}
