//! Dialects: the same tokenizer files read as transformers 4 and as transformers 5 read them
//! (vLLM >= 0.32 runs transformers 5). Pinned ids from transformers 4.57 and 5.19 on Phi-3-mini's
//! files (`../shared/fixtures`, read at test time; a skip when absent,
//! a failure under `CI=true`), rules checked on a
//! Llama-2-shaped tokenizer built here, and the rebuilt dialect's fast path compared with its
//! full `tokenizers` pipeline on adversarial and random text.

mod common;

use common::{NASTY, assert_fast_equals_reference};
use kvsight_tokenizer::{ChatExtras, ChatMessage, Dialect, ModelTokenizer, TokenizerError};
use serde_json::{Value as Json, json};

/// Phi-3-mini's tokenizer files, under `../shared`.
const PHI3_JSON: &str = "fixtures/tokenizers/phi-3-mini/tokenizer.json";

/// Phi-3's tokenizer in `dialect`, or `None` (after printing the skip line) when the fixture is
/// absent.
fn phi3(test: &str, dialect: Dialect) -> Option<ModelTokenizer> {
    let tokenizer_json = kvsight_harness::fixture_or_skip(test, PHI3_JSON)?;
    let json = std::fs::read(&tokenizer_json).expect("read tokenizer.json");
    let config =
        std::fs::read(tokenizer_json.with_file_name("tokenizer_config.json")).expect("read config");
    let tok = ModelTokenizer::from_bytes(&json, Some(&config)).expect("phi-3 tokenizer");
    Some(tok.in_dialect(dialect).expect("phi-3 in the dialect"))
}

/// Both of Phi-3's dialects, or `None` when the fixture is absent.
fn phi3_both(test: &str) -> Option<(ModelTokenizer, ModelTokenizer)> {
    Some((
        phi3(test, Dialect::Transformers4)?,
        phi3(test, Dialect::Transformers5Rebuilt)?,
    ))
}

#[test]
fn phi3_issue_vectors_in_both_dialects() {
    let Some((tf4, tf5)) = phi3_both("phi3_issue_vectors_in_both_dialects") else {
        return;
    };
    // transformers 5.19 on Phi-3's files (no config.json: LlamaTokenizer, rebuilt), and 4.57.
    let vectors: [(&str, &[u32], &[u32]); 4] = [
        (" leading", &[29871, 8236], &[8236]),
        (
            "<|user|>\nBe brief.<|end|>\n<|assistant|>\n",
            &[32010, 1522, 11473, 29889, 32007, 32001],
            &[32010, 3629, 11473, 29889, 32007, 32001],
        ),
        ("Hello world", &[15043, 3186], &[15043, 3186]),
        ("a\nb", &[263, 13, 29890], &[263, 13, 29890]),
    ];
    for (text, ids4, ids5) in vectors {
        assert_eq!(
            tf4.encode(text, false).expect("encode"),
            ids4,
            "tf4 {text:?}"
        );
        assert_eq!(
            tf5.encode(text, false).expect("encode"),
            ids5,
            "tf5 {text:?}"
        );
    }
}

/// transformers 4.57 and 5.19 (rebuilt `LlamaTokenizer`) on Phi-3-mini's files, the same ids
/// with and without `add_special_tokens` (Phi-3's post-processor adds nothing). transformers 5
/// with `config.json` `model_type: phi3` (its `TokenizersBackend`) gives the transformers 4 ids
/// on every row.
const PHI3_VECTORS: &[(&str, &[u32], &[u32])] = &[
    ("", &[], &[]),
    (" ", &[259], &[29871]),
    ("  ", &[1678], &[259]),
    ("Hello world", &[15043, 3186], &[15043, 3186]),
    (" leading", &[29871, 8236], &[8236]),
    (
        "  two leading spaces",
        &[259, 1023, 8236, 8162],
        &[29871, 1023, 8236, 8162],
    ),
    ("   three", &[1678, 2211], &[259, 2211]),
    ("trailing ", &[25053, 29871], &[25053, 29871]),
    ("trailing two  ", &[25053, 1023, 259], &[25053, 1023, 259]),
    (
        "multiple   inner    spaces",
        &[2999, 259, 6426, 1678, 8162],
        &[2999, 259, 6426, 1678, 8162],
    ),
    ("a\nb", &[263, 13, 29890], &[263, 13, 29890]),
    (
        "\nnewline first",
        &[29871, 13, 1482, 1220, 937],
        &[29871, 13, 1482, 1220, 937],
    ),
    (
        "line1\n\nline3\n",
        &[1196, 29896, 13, 13, 1220, 29941, 13],
        &[1196, 29896, 13, 13, 1220, 29941, 13],
    ),
    (
        "\ttab first",
        &[29871, 12, 3891, 937],
        &[29871, 12, 3891, 937],
    ),
    (
        "tab\tinside\t\tdouble",
        &[4434, 12, 26102, 12, 12, 8896],
        &[4434, 12, 26102, 12, 12, 8896],
    ),
    (
        " \t mixed ws \n end",
        &[259, 12, 12849, 16904, 29871, 13, 1095],
        &[29871, 12, 12849, 16904, 29871, 13, 1095],
    ),
    (
        "Hello, World! How's it going?",
        &[
            15043, 29892, 2787, 29991, 1128, 29915, 29879, 372, 2675, 29973,
        ],
        &[
            15043, 29892, 2787, 29991, 1128, 29915, 29879, 372, 2675, 29973,
        ],
    ),
    (
        "naïve café résumé",
        &[1055, 30085, 345, 274, 28059, 6896, 398, 29948],
        &[1055, 30085, 345, 274, 28059, 6896, 398, 29948],
    ),
    (
        "日本語のテキスト",
        &[
            29871, 30325, 30346, 30968, 30199, 30572, 30454, 30255, 30279,
        ],
        &[
            29871, 30325, 30346, 30968, 30199, 30572, 30454, 30255, 30279,
        ],
    ),
    (
        "emoji 😀🎉 test",
        &[
            953, 29877, 2397, 29871, 243, 162, 155, 131, 243, 162, 145, 140, 1243,
        ],
        &[
            953, 29877, 2397, 29871, 243, 162, 155, 131, 243, 162, 145, 140, 1243,
        ],
    ),
    (
        "😀",
        &[29871, 243, 162, 155, 131],
        &[29871, 243, 162, 155, 131],
    ),
    (
        " 😀 leading-space emoji",
        &[259, 243, 162, 155, 131, 8236, 29899, 3493, 953, 29877, 2397],
        &[
            29871, 243, 162, 155, 131, 8236, 29899, 3493, 953, 29877, 2397,
        ],
    ),
    (
        "Ωmega ∑ ∞ ≠",
        &[
            29871, 30357, 29885, 2442, 29871, 31060, 29871, 30306, 29871, 30487,
        ],
        &[
            29871, 30357, 29885, 2442, 29871, 31060, 29871, 30306, 29871, 30487,
        ],
    ),
    (
        "\u{a0}nbsp lead",
        &[20246, 14239, 3275],
        &[20246, 14239, 3275],
    ),
    (
        "zero\u{200b}width",
        &[5225, 30166, 2103],
        &[5225, 30166, 2103],
    ),
    (
        "<|user|>\nBe brief.<|end|>\n<|assistant|>\n",
        &[32010, 1522, 11473, 29889, 32007, 32001],
        &[32010, 3629, 11473, 29889, 32007, 32001],
    ),
    ("<|user|>Be", &[32010, 1522], &[32010, 3629]),
    ("<|user|> Be", &[32010, 1522], &[32010, 3629]),
    ("<|user|>  Be", &[32010, 1522], &[32010, 3629]),
    ("<|user|>\n\n  Be", &[32010, 1522], &[32010, 3629]),
    (
        "<|user|>\nHello<|end|>",
        &[32010, 15043, 32007],
        &[32010, 10994, 32007],
    ),
    ("Hi<|end|>", &[6324, 32007], &[6324, 32007]),
    ("Hi <|end|>", &[6324, 29871, 32007], &[6324, 29871, 32007]),
    ("Hi<|end|>there", &[6324, 32007, 727], &[6324, 32007, 12711]),
    (
        "Hi<|end|> there",
        &[6324, 32007, 727],
        &[6324, 32007, 12711],
    ),
    (
        "Hi<|end|>\nthere",
        &[6324, 32007, 727],
        &[6324, 32007, 12711],
    ),
    ("<|end|><|end|>", &[32007, 32007], &[32007, 32007]),
    ("<|end|> <|end|>", &[32007, 32007], &[32007, 32007]),
    (
        "<|user|><|assistant|>text",
        &[32010, 32001, 1426],
        &[32010, 32001, 726],
    ),
    ("<s>Hello", &[1, 15043], &[1, 10994]),
    ("<s> Hello", &[1, 29871, 15043], &[1, 15043]),
    ("Hello<s>world", &[15043, 1, 3186], &[15043, 1, 11526]),
    (
        "Hello <s> world",
        &[15043, 29871, 1, 29871, 3186],
        &[15043, 29871, 1, 3186],
    ),
    ("</s>after eos", &[2, 1156, 321, 359], &[2, 7045, 321, 359]),
    ("x</s>  y", &[921, 2, 343], &[921, 2, 29891]),
    ("<|endoftext|>next", &[32000, 2446], &[32000, 4622]),
    ("<|endoftext|> next", &[32000, 29871, 2446], &[32000, 2446]),
    ("text<|endoftext|>", &[1426, 32000], &[1426, 32000]),
    ("<unk>unk", &[0, 443, 29895], &[0, 2960]),
    (
        "<|system|>\nYou are helpful.<|end|>\n<|user|>\nWhat is 2+2?<|end|>\n<|assistant|>\n",
        &[
            32006, 887, 526, 8444, 29889, 32007, 32010, 1724, 338, 29871, 29906, 29974, 29906,
            29973, 32007, 32001,
        ],
        &[
            32006, 3492, 526, 8444, 29889, 32007, 32010, 5618, 338, 29871, 29906, 29974, 29906,
            29973, 32007, 32001,
        ],
    ),
    (
        "code: def f(x):\n    return x * 2\n",
        &[
            775, 29901, 822, 285, 29898, 29916, 1125, 13, 1678, 736, 921, 334, 29871, 29906, 13,
        ],
        &[
            775, 29901, 822, 285, 29898, 29916, 1125, 13, 1678, 736, 921, 334, 29871, 29906, 13,
        ],
    ),
    (
        "    indented code",
        &[268, 1399, 14927, 775],
        &[1678, 1399, 14927, 775],
    ),
    (
        "<|user|>\n    indented after special",
        &[32010, 1399, 14927, 1156, 4266],
        &[32010, 12860, 287, 1156, 4266],
    ),
    (
        "▁already metaspace",
        &[29871, 2307, 1539, 294, 3535],
        &[2307, 1539, 294, 3535],
    ),
    (
        " ▁space then metaspace",
        &[259, 2913, 769, 1539, 294, 3535],
        &[29871, 2913, 769, 1539, 294, 3535],
    ),
    (
        "<|user|>▁after special",
        &[32010, 29871, 1156, 4266],
        &[32010, 1156, 4266],
    ),
    (
        "<|user|",
        &[529, 29989, 1792, 29989],
        &[529, 29989, 1792, 29989],
    ),
    (
        "<| user |>",
        &[529, 29989, 1404, 891, 29958],
        &[529, 29989, 1404, 891, 29958],
    ),
    (
        "1234567890 3.14159",
        &[
            29871, 29896, 29906, 29941, 29946, 29945, 29953, 29955, 29947, 29929, 29900, 29871,
            29941, 29889, 29896, 29946, 29896, 29945, 29929,
        ],
        &[
            29871, 29896, 29906, 29941, 29946, 29945, 29953, 29955, 29947, 29929, 29900, 29871,
            29941, 29889, 29896, 29946, 29896, 29945, 29929,
        ],
    ),
    (
        "UPPER lower MiXeD",
        &[11901, 13171, 5224, 5493, 29990, 29872, 29928],
        &[11901, 13171, 5224, 5493, 29990, 29872, 29928],
    ),
];

#[test]
fn phi3_research_vectors_in_both_dialects() {
    let Some((tf4, tf5)) = phi3_both("phi3_research_vectors_in_both_dialects") else {
        return;
    };
    let mut differing = 0;
    for (text, ids4, ids5) in PHI3_VECTORS {
        for add_special_tokens in [false, true] {
            let what = format!("{text:?}, add_special_tokens {add_special_tokens}");
            assert_eq!(
                tf4.encode(text, add_special_tokens).expect("tf4"),
                *ids4,
                "tf4 {what}"
            );
            assert_eq!(
                tf5.encode(text, add_special_tokens).expect("tf5"),
                *ids5,
                "tf5 {what}"
            );
            assert_eq!(
                tf5.encode_reference(text, add_special_tokens)
                    .expect("tf5 full"),
                *ids5,
                "tf5 full pipeline {what}"
            );
        }
        differing += usize::from(ids4 != ids5);
    }
    assert_eq!(differing, 32, "the table is the research's, whole");
}

#[test]
fn phi3_has_two_dialects_and_the_rebuilt_one_takes_the_fast_path() {
    let Some((tf4, tf5)) =
        phi3_both("phi3_has_two_dialects_and_the_rebuilt_one_takes_the_fast_path")
    else {
        return;
    };
    // Phi-3's config says add_bos_token false and its post-processor adds nothing: transformers
    // 5 reading the file as it is gives transformers 4's ids, so that dialect is no other.
    assert_eq!(
        tf4.dialects(),
        [Dialect::Transformers4, Dialect::Transformers5Rebuilt]
    );
    assert_eq!(tf5.dialects(), tf4.dialects(), "a property of the files");
    assert_eq!(tf4.dialect(), Dialect::Transformers4);
    assert_eq!(tf5.dialect(), Dialect::Transformers5Rebuilt);
    assert_eq!(tf4.fast_path(), Some("sentencepiece"));
    assert_eq!(tf5.fast_path(), Some("sentencepiece"));
    assert_eq!(tf4.digest(), tf5.digest(), "the digest names the files");
    let as_is = tf4
        .in_dialect(Dialect::Transformers5)
        .expect("transformers 5 as is");
    for (text, ids4, _) in PHI3_VECTORS {
        assert_eq!(as_is.encode_completion(text).expect("encode"), *ids4);
    }
}

/// Chats as vLLM encodes them (rendered, then `add_special_tokens=false`): every message body
/// follows a special token whose `rstrip` swallows the newline, so transformers 5 gives it no "▁".
#[test]
fn phi3_chats_in_both_dialects() {
    let Some((tf4, tf5)) = phi3_both("phi3_chats_in_both_dialects") else {
        return;
    };
    /// Messages, `add_generation_prompt`, transformers 4's ids, transformers 5's.
    type Chat = (Vec<ChatMessage>, bool, &'static [u32], &'static [u32]);
    let chats: [Chat; 3] = [
        (
            vec![
                ChatMessage::new("system", "You are terse."),
                ChatMessage::new("user", "Be brief. What is 2+2?"),
                ChatMessage::new("assistant", "It is 4."),
            ],
            true,
            &[
                32006, 887, 526, 1935, 344, 29889, 32007, 32010, 1522, 11473, 29889, 1724, 338,
                29871, 29906, 29974, 29906, 29973, 32007, 32001, 739, 338, 29871, 29946, 29889,
                32007, 32001,
            ],
            &[
                32006, 3492, 526, 1935, 344, 29889, 32007, 32010, 3629, 11473, 29889, 1724, 338,
                29871, 29906, 29974, 29906, 29973, 32007, 32001, 3112, 338, 29871, 29946, 29889,
                32007, 32001,
            ],
        ),
        (
            vec![
                ChatMessage::new("user", "Hi"),
                ChatMessage::new("assistant", " Hello there!"),
                ChatMessage::new("user", "\n  Tell me a joke."),
            ],
            false,
            &[
                32010, 6324, 32007, 32001, 15043, 727, 29991, 32007, 32010, 24948, 592, 263, 2958,
                446, 29889, 32007, 32000,
            ],
            &[
                32010, 18567, 32007, 32001, 10994, 727, 29991, 32007, 32010, 29911, 514, 592, 263,
                2958, 446, 29889, 32007, 32000,
            ],
        ),
        (
            vec![
                ChatMessage::new("user", "What is the capital of France?"),
                ChatMessage::new("assistant", "The capital of France is Paris."),
            ],
            true,
            &[
                32010, 1724, 338, 278, 7483, 310, 3444, 29973, 32007, 32001, 450, 7483, 310, 3444,
                338, 3681, 29889, 32007, 32001,
            ],
            &[
                32010, 5618, 338, 278, 7483, 310, 3444, 29973, 32007, 32001, 1576, 7483, 310, 3444,
                338, 3681, 29889, 32007, 32001,
            ],
        ),
    ];
    let extras = ChatExtras::default();
    for (messages, generation_prompt, ids4, ids5) in chats {
        let rendered = tf4
            .render_chat(&messages, generation_prompt, &extras)
            .expect("render");
        assert_eq!(
            tf4.encode_chat(&messages, generation_prompt, &extras)
                .expect("tf4"),
            ids4,
            "tf4 {rendered:?}"
        );
        assert_eq!(
            tf5.encode_chat(&messages, generation_prompt, &extras)
                .expect("tf5"),
            ids5,
            "tf5 {rendered:?}"
        );
    }
}

#[test]
fn phi3_rebuilt_fast_path_equals_its_full_pipeline() {
    let Some(tok) = phi3(
        "phi3_rebuilt_fast_path_equals_its_full_pipeline",
        Dialect::Transformers5Rebuilt,
    ) else {
        return;
    };
    for text in NASTY {
        assert_fast_equals_reference(&tok, text);
        assert_fast_equals_reference(&tok, &format!("<|user|>{text}x{text}"));
        assert_fast_equals_reference(&tok, &format!("{text}</s>{text}"));
    }
    assert_fast_equals_reference(&tok, &"中文字符".repeat(200));
    assert_fast_equals_reference(&tok, &" word".repeat(300));
    assert_fast_equals_reference(&tok, &NASTY.concat().repeat(5));
}

/// A Llama-2-shaped tokenizer built here (no fixture): byte fallback over all 256 bytes, "▁"
/// words merged by hand-picked merges (none puts a "▁" after another character, as a
/// sentencepiece-trained vocabulary never does; "▁▁" merges rank last, as in Llama 2), the
/// normalizer `Prepend("▁")` + `Replace(" ", "▁")`, chat tokens `<|user|>` and `<|assistant|>`
/// (`rstrip`) and `<|end|>` (no `rstrip`), and `[TOOL]`, a normalized, non-special added token.
/// `post_processor` is the caller's; `config` is merged over Llama 2's tokenizer_config.json.
fn llama2_shaped(post_processor: Json, config: Json) -> ModelTokenizer {
    const ALPHABET: &str = "▁abdeghilnorstwyBHT.,!?'\n\t";
    const MERGES: &[(&str, &str)] = &[
        ("e", "a"),
        ("i", "n"),
        ("in", "g"),
        ("▁", "l"),
        ("▁l", "ea"),
        ("▁lea", "d"),
        ("▁lead", "ing"),
        ("a", "b"),
        ("▁", "ab"),
        ("▁", "a"),
        ("▁", "b"),
        ("B", "e"),
        ("▁", "Be"),
        ("e", "l"),
        ("el", "l"),
        ("ell", "o"),
        ("H", "ello"),
        ("▁", "Hello"),
        ("w", "o"),
        ("r", "l"),
        ("wo", "rl"),
        ("worl", "d"),
        ("▁", "world"),
        ("t", "h"),
        ("th", "e"),
        ("▁", "the"),
        ("▁", "\n"),
        ("▁", "\t"),
        ("▁", "▁"),
        ("▁▁", "▁"),
        ("▁▁", "▁▁"),
    ];
    let mut vocab = serde_json::Map::new();
    let mut add = |token: String| {
        let id = vocab.len();
        vocab.entry(token).or_insert(Json::from(id));
    };
    for token in ["<unk>", "<s>", "</s>"] {
        add(token.to_owned());
    }
    for byte in 0..=255u8 {
        add(format!("<0x{byte:02X}>"));
    }
    for c in ALPHABET.chars() {
        add(c.to_string());
    }
    for (left, right) in MERGES {
        add(format!("{left}{right}"));
    }
    let merges: Vec<String> = MERGES.iter().map(|(l, r)| format!("{l} {r}")).collect();
    let next = vocab.len();
    let added = |id: usize, content: &str, rstrip: bool, normalized: bool, special: bool| {
        json!({"id": id, "content": content, "single_word": false, "lstrip": false,
               "rstrip": rstrip, "normalized": normalized, "special": special})
    };
    let tokenizer_json = json!({
        "version": "1.0",
        "truncation": null,
        "padding": null,
        "added_tokens": [
            added(0, "<unk>", false, false, true),
            added(1, "<s>", false, false, true),
            added(2, "</s>", false, false, true),
            added(next, "<|user|>", true, false, true),
            added(next + 1, "<|assistant|>", true, false, true),
            added(next + 2, "<|end|>", false, false, true),
            added(next + 3, "[TOOL]", false, true, false),
        ],
        "normalizer": {"type": "Sequence", "normalizers": [
            {"type": "Prepend", "prepend": "▁"},
            {"type": "Replace", "pattern": {"String": " "}, "content": "▁"}
        ]},
        "pre_tokenizer": null,
        "post_processor": post_processor,
        "decoder": null,
        "model": {
            "type": "BPE", "dropout": null, "unk_token": "<unk>",
            "continuing_subword_prefix": null, "end_of_word_suffix": null,
            "fuse_unk": true, "byte_fallback": true, "ignore_merges": false,
            "vocab": vocab, "merges": merges,
        }
    });
    let mut llama_config = json!({
        "tokenizer_class": "LlamaTokenizer",
        "add_bos_token": true,
        "add_eos_token": false,
        "legacy": false,
        "bos_token": "<s>",
        "eos_token": "</s>",
        "unk_token": "<unk>",
        "chat_template": "{% for m in messages %}{% if m['role'] == 'user' %}{{ '<|user|>\n' + m['content'] + '<|end|>\n' }}{% elif m['role'] == 'assistant' %}{{ '<|assistant|>\n' + m['content'] + '<|end|>\n' }}{% else %}{{ m['content'] + '\n' }}{% endif %}{% endfor %}{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% endif %}",
    });
    for (key, value) in config.as_object().expect("an object") {
        llama_config[key] = value.clone();
    }
    ModelTokenizer::from_bytes(
        &serde_json::to_vec(&tokenizer_json).expect("json"),
        Some(&serde_json::to_vec(&llama_config).expect("json")),
    )
    .expect("llama-2-shaped tokenizer")
}

fn bos_post_processor() -> Json {
    json!({
        "type": "TemplateProcessing",
        "single": [{"SpecialToken": {"id": "<s>", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
        "pair": [{"SpecialToken": {"id": "<s>", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}},
                 {"SpecialToken": {"id": "<s>", "type_id": 1}}, {"Sequence": {"id": "B", "type_id": 1}}],
        "special_tokens": {"<s>": {"id": "<s>", "ids": [1], "tokens": ["<s>"]}}
    })
}

/// The Llama-2 shape as shipped (BOS from the post-processor and from the config), in `dialect`
/// and with `config` over the shipped one.
fn llama2(dialect: Dialect, config: Json) -> ModelTokenizer {
    llama2_shaped(bos_post_processor(), config)
        .in_dialect(dialect)
        .expect("dialect")
}

/// The ids of vocabulary entries.
fn ids(tok: &ModelTokenizer, tokens: &[&str]) -> Vec<u32> {
    tokens
        .iter()
        .map(|t| {
            tok.token_to_id(t)
                .unwrap_or_else(|| panic!("{t:?} in the vocabulary"))
        })
        .collect()
}

/// `text` by the fast path, checked against the full pipeline.
fn encode(tok: &ModelTokenizer, text: &str, add_special_tokens: bool) -> Vec<u32> {
    let ids = tok.encode(text, add_special_tokens).expect("encode");
    assert_eq!(
        ids,
        tok.encode_reference(text, add_special_tokens)
            .expect("reference"),
        "{} {text:?}",
        tok.dialect()
    );
    ids
}

/// The rows of the research's Llama-2-shaped table (FINDINGS §6), on this vocabulary: "▁" once
/// at the very start, never after an added token, none added to text that starts with a space,
/// and normalized added tokens matched on the raw text.
#[test]
fn llama2_shaped_rebuilt_rules() {
    let tf4 = llama2(Dialect::Transformers4, json!({}));
    let tf5 = llama2(Dialect::Transformers5Rebuilt, json!({}));
    assert_eq!(
        tf4.dialects(),
        [Dialect::Transformers4, Dialect::Transformers5Rebuilt]
    );
    // A normalized added token keeps transformers 4 on the full pipeline; without a normalizer
    // the rebuilt dialect has no reason to.
    assert_eq!(tf4.fast_path(), None);
    assert_eq!(tf5.fast_path(), Some("sentencepiece"));
    let rows: [(&str, bool, &[&str], &[&str]); 10] = [
        (
            "Hello world",
            true,
            &["<s>", "▁Hello", "▁world"],
            &["<s>", "▁Hello", "▁world"],
        ),
        (
            " leading",
            true,
            &["<s>", "▁", "▁leading"],
            &["<s>", "▁leading"],
        ),
        (
            "<|user|>\nBe<|end|>\n<|assistant|>\n",
            false,
            &["<|user|>", "▁Be", "<|end|>", "▁\n", "<|assistant|>"],
            &["<|user|>", "Be", "<|end|>", "\n", "<|assistant|>"],
        ),
        (
            "<|end|> <|end|>",
            false,
            &["<|end|>", "▁▁", "<|end|>"],
            &["<|end|>", "▁", "<|end|>"],
        ),
        (
            "<s> Hello",
            true,
            &["<s>", "<s>", "▁", "▁Hello"],
            &["<s>", "<s>", "▁Hello"],
        ),
        (
            "a [TOOL] b",
            true,
            &["<s>", "▁a", "[TOOL]", "▁b"],
            &["<s>", "▁a", "▁", "[TOOL]", "▁b"],
        ),
        (
            "a[TOOL]b",
            true,
            &[
                "<s>", "▁a", "<0x5B>", "T", "<0x4F>", "<0x4F>", "<0x4C>", "<0x5D>", "b",
            ],
            &["<s>", "▁a", "[TOOL]", "b"],
        ),
        (
            "<|assistant|>  the",
            true,
            &["<s>", "<|assistant|>", "▁the"],
            &["<s>", "<|assistant|>", "the"],
        ),
        ("\tthe", false, &["▁\t", "the"], &["▁\t", "the"]),
        ("ab  ab", false, &["▁ab", "▁", "▁ab"], &["▁ab", "▁", "▁ab"]),
    ];
    for (text, add_special_tokens, tokens4, tokens5) in rows {
        assert_eq!(
            encode(&tf4, text, add_special_tokens),
            ids(&tf4, tokens4),
            "tf4 {text:?}"
        );
        assert_eq!(
            encode(&tf5, text, add_special_tokens),
            ids(&tf5, tokens5),
            "tf5 {text:?}"
        );
    }
    // Chat: rendered, then without special tokens; every body follows an `rstrip` token.
    let chat = [
        ChatMessage::new("user", "Be"),
        ChatMessage::new("assistant", "the"),
    ];
    let extras = ChatExtras::default();
    assert_eq!(
        tf4.encode_chat(&chat, true, &extras).expect("chat"),
        ids(
            &tf4,
            &[
                "<|user|>",
                "▁Be",
                "<|end|>",
                "▁\n",
                "<|assistant|>",
                "▁the",
                "<|end|>",
                "▁\n",
                "<|assistant|>"
            ]
        )
    );
    assert_eq!(
        tf5.encode_chat(&chat, true, &extras).expect("chat"),
        ids(
            &tf5,
            &[
                "<|user|>",
                "Be",
                "<|end|>",
                "\n",
                "<|assistant|>",
                "the",
                "<|end|>",
                "\n",
                "<|assistant|>"
            ]
        )
    );
}

/// `legacy: true` makes transformers 5 prepend "▁" to every text that lacks one (as transformers
/// 4 does after added tokens), `add_prefix_space: false` to none.
#[test]
fn legacy_and_add_prefix_space_set_the_prepend_scheme() {
    let always = llama2(Dialect::Transformers5Rebuilt, json!({"legacy": true}));
    assert_eq!(
        encode(&always, "<|user|>\nBe", false),
        ids(&always, &["<|user|>", "▁Be"])
    );
    assert_eq!(
        encode(&always, " leading", false),
        ids(&always, &["▁leading"])
    );
    let never = llama2(
        Dialect::Transformers5Rebuilt,
        json!({"add_prefix_space": false}),
    );
    assert_eq!(
        encode(&never, "Hello world", false),
        ids(&never, &["Hello", "▁world"])
    );
    assert_eq!(
        encode(&never, " leading", false),
        ids(&never, &["▁leading"])
    );
    // transformers 4 reads neither flag.
    let tf4 = llama2(Dialect::Transformers4, json!({"add_prefix_space": false}));
    assert_eq!(
        encode(&tf4, "Hello world", false),
        ids(&tf4, &["▁Hello", "▁world"])
    );
}

/// transformers 5 ignores `add_bos_token` when tokenizer.json exists: a Llama config asking for
/// BOS over a file whose post-processor adds none gives transformers 5 a dialect of its own.
#[test]
fn config_flags_that_change_the_post_processor_make_transformers5_distinct() {
    let tok = llama2_shaped(Json::Null, json!({}));
    assert_eq!(tok.dialects(), Dialect::ALL);
    let text = "Hello world";
    let words = ["▁Hello", "▁world"];
    assert_eq!(
        tok.encode_completion(text).expect("tf4"),
        ids(&tok, &["<s>", words[0], words[1]])
    );
    for dialect in [Dialect::Transformers5, Dialect::Transformers5Rebuilt] {
        let tf5 = tok.in_dialect(dialect).expect("dialect");
        assert_eq!(tf5.encode_completion(text).expect("tf5"), ids(&tf5, &words));
    }
    // The shipped shape (the flags agree with the file) has no such dialect.
    assert_eq!(
        llama2(Dialect::Transformers4, json!({})).dialects(),
        [Dialect::Transformers4, Dialect::Transformers5Rebuilt]
    );
}

#[test]
fn a_byte_level_tokenizer_has_only_the_transformers4_dialect() {
    let json = serde_json::to_vec(&json!({
        "version": "1.0", "truncation": null, "padding": null, "added_tokens": [],
        "normalizer": null,
        "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": true},
        "post_processor": null, "decoder": null,
        "model": {"type": "BPE", "dropout": null, "unk_token": null, "continuing_subword_prefix": null,
                  "end_of_word_suffix": null, "fuse_unk": false, "byte_fallback": false,
                  "vocab": {"H": 0, "i": 1, "Ġ": 2, "Hi": 3}, "merges": ["H i"]}
    }))
    .expect("json");
    let tok = ModelTokenizer::from_bytes(
        &json,
        Some(b"{\"tokenizer_class\": \"LlamaTokenizerFast\"}"),
    )
    .expect("tokenizer");
    assert_eq!(tok.dialects(), [Dialect::Transformers4]);
    assert_eq!(
        tok.in_dialect(Dialect::Transformers5Rebuilt).map(|_| ()),
        Err(TokenizerError::DialectDoesNotApply(
            Dialect::Transformers5Rebuilt
        ))
    );
    let as_is = tok.in_dialect(Dialect::Transformers5).expect("as is");
    assert_eq!(as_is.encode_completion("Hi Hi").expect("encode"), [3, 2, 3]);
}

mod proptests {
    use proptest::prelude::*;

    use super::*;

    fn nasty_text() -> impl Strategy<Value = String> {
        prop::collection::vec(
            prop_oneof![
                prop::sample::select(NASTY).prop_map(str::to_owned),
                prop::sample::select(&["[TOOL]", "leading", "Hello", "the", "ab", " ", "\t"][..])
                    .prop_map(str::to_owned),
            ],
            0..40,
        )
        .prop_map(|pieces| pieces.concat())
    }

    fn any_text() -> impl Strategy<Value = String> {
        prop_oneof![nasty_text(), any::<String>()]
    }

    fn fast_equals_full(tok: &ModelTokenizer, text: &str) -> Result<(), TestCaseError> {
        for add_special_tokens in [false, true] {
            prop_assert_eq!(
                tok.encode(text, add_special_tokens).expect("fast"),
                tok.encode_reference(text, add_special_tokens)
                    .expect("full"),
                "{} {:?}",
                tok.dialect(),
                text
            );
        }
        Ok(())
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(256))]

        #[test]
        fn phi3_rebuilt_fast_path_equals_its_full_pipeline(text in any_text()) {
            thread_local! {
                static TOK: Option<ModelTokenizer> = phi3(
                    "phi3_rebuilt_fast_path_equals_its_full_pipeline (proptest)",
                    Dialect::Transformers5Rebuilt,
                );
            }
            TOK.with(|tok| match tok {
                Some(tok) => fast_equals_full(tok, &text),
                None => Ok(()),
            })?;
        }

        #[test]
        fn llama2_shaped_rebuilt_fast_path_equals_its_full_pipeline(text in any_text()) {
            thread_local! {
                /// The three prepend schemes: first (the default), always (`legacy`), never.
                static TOKS: Vec<ModelTokenizer> = [
                    json!({}),
                    json!({"legacy": true}),
                    json!({"add_prefix_space": false}),
                ]
                .into_iter()
                .map(|config| llama2(Dialect::Transformers5Rebuilt, config))
                .collect();
            }
            TOKS.with(|toks| toks.iter().try_for_each(|tok| fast_equals_full(tok, &text)))?;
        }
    }
}
