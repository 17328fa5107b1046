//! The project's Llama-2-shaped tokenizer (`kvsight_sim::llama2_tokenizer`): deterministic
//! training, the ids transformers 4.57 and 5.19 give for it (pinned; transformers 5 loads it as
//! a `LlamaTokenizer` and rebuilds it, with `config.json` `model_type: llama`), and the fast
//! paths of both dialects against their full pipelines on random text.

mod tokenizer_pin;

use kvsight_sim::llama2_tokenizer;
use kvsight_tokenizer::{ChatExtras, ChatMessage, Dialect, ModelTokenizer};
use proptest::prelude::*;

/// sha256 of the produced tokenizer.json. A change moves the ids pinned below: bump
/// `llama2_tokenizer::VERSION` and compute them again with transformers 4 and 5.
const TOKENIZER_JSON_SHA256: &str =
    "c1bd46d6be23291bfc25c0f83a4312a7489a9e7d99f46057eef70cfa6802cdf9";

#[test]
fn llama2_training_is_deterministic_and_pinned() {
    let first = llama2_tokenizer::build().expect("train");
    let second = llama2_tokenizer::build().expect("train again");
    assert!(
        first == second,
        "two trainings must give byte-identical files"
    );
    tokenizer_pin::assert_pinned(
        first.tokenizer_json.as_bytes(),
        TOKENIZER_JSON_SHA256,
        "bump llama2_tokenizer::VERSION and re-pin the ids",
    );
}

/// Both dialects, from the cached files.
fn both() -> (ModelTokenizer, ModelTokenizer) {
    let tf4 = llama2_tokenizer::load().expect("llama-2-shaped tokenizer");
    let tf5 = tf4
        .in_dialect(Dialect::Transformers5Rebuilt)
        .expect("rebuilt dialect");
    (tf4, tf5)
}

/// (text, transformers 4.57 ids, transformers 5.19 ids), `add_special_tokens=true`; without
/// special tokens the same ids minus the leading BOS.
const VECTORS: &[(&str, &[u32], &[u32])] = &[
    ("", &[1], &[1]),
    (" ", &[1, 327, 327], &[1, 327]),
    ("  ", &[1, 327, 327, 327], &[1, 327, 327]),
    (
        "Hello world",
        &[1, 583, 392, 444, 1140],
        &[1, 583, 392, 444, 1140],
    ),
    (" leading", &[1, 327, 675, 1043], &[1, 675, 1043]),
    (
        "  two leading spaces",
        &[1, 327, 327, 328, 323, 315, 675, 1043, 343, 316, 502, 330],
        &[1, 327, 328, 323, 315, 675, 1043, 343, 316, 502, 330],
    ),
    (
        "   three",
        &[1, 327, 327, 327, 364, 334, 305],
        &[1, 327, 327, 364, 334, 305],
    ),
    (
        "trailing ",
        &[1, 849, 461, 372, 327],
        &[1, 849, 461, 372, 327],
    ),
    ("a\nb", &[1, 373, 259, 302], &[1, 373, 259, 302]),
    (
        "\nnewline first",
        &[1, 399, 314, 678, 507, 305, 755],
        &[1, 399, 314, 678, 507, 305, 755],
    ),
    (
        "\ttab first",
        &[1, 327, 12, 320, 1006, 755],
        &[1, 327, 12, 320, 1006, 755],
    ),
    (
        " \t mixed ws \n end",
        &[1, 327, 327, 12, 1503, 324, 406, 349, 319, 399, 918],
        &[1, 327, 12, 1503, 324, 406, 349, 319, 399, 918],
    ),
    (
        "naïve café",
        &[1, 409, 301, 198, 178, 597, 335, 516, 198, 172],
        &[1, 409, 301, 198, 178, 597, 335, 516, 198, 172],
    ),
    (
        "日本語",
        &[1, 327, 233, 154, 168, 233, 159, 175, 235, 173, 161],
        &[1, 327, 233, 154, 168, 233, 159, 175, 235, 173, 161],
    ),
    (
        "emoji 😀🎉 test",
        &[
            1, 391, 313, 315, 310, 309, 327, 243, 162, 155, 131, 243, 162, 145, 140, 985,
        ],
        &[
            1, 391, 313, 315, 310, 309, 327, 243, 162, 155, 131, 243, 162, 145, 140, 985,
        ],
    ),
    (
        "<|user|>\nBe brief.<|end|>\n<|assistant|>\n",
        &[1, 3257, 474, 305, 370, 641, 264, 3259, 3258],
        &[1, 3257, 278, 305, 370, 641, 264, 3259, 3258],
    ),
    ("<|user|>Be", &[1, 3257, 474, 305], &[1, 3257, 278, 305]),
    ("<|user|>  Be", &[1, 3257, 474, 305], &[1, 3257, 278, 305]),
    (
        "Hi<|end|>there",
        &[1, 583, 309, 3259, 331, 334],
        &[1, 583, 309, 3259, 320, 1646],
    ),
    ("<|end|> <|end|>", &[1, 3259, 3259], &[1, 3259, 3259]),
    ("<s>Hello", &[1, 1, 583, 392, 444], &[1, 1, 284, 392, 444]),
    (
        "<s> Hello",
        &[1, 1, 327, 583, 392, 444],
        &[1, 1, 583, 392, 444],
    ),
    (
        "Hello<s>world",
        &[1, 583, 392, 444, 1, 1140],
        &[1, 583, 392, 444, 1, 323, 1049],
    ),
    (
        "</s>after eos",
        &[1, 2, 501, 391, 315, 319],
        &[1, 2, 301, 393, 391, 315, 319],
    ),
    ("<unk>unk", &[1, 0, 437, 311], &[1, 0, 321, 314, 311]),
    (
        "▁already metaspace",
        &[
            1, 327, 554, 334, 456, 325, 338, 432, 301, 319, 316, 502, 305,
        ],
        &[1, 554, 334, 456, 325, 338, 432, 301, 319, 316, 502, 305],
    ),
    (
        "<|user|>▁after special",
        &[1, 3257, 327, 501, 790, 582],
        &[1, 3257, 501, 790, 582],
    ),
    (
        "    indented code",
        &[1, 327, 327, 327, 327, 381, 1178, 387, 347, 304, 305],
        &[1, 327, 327, 327, 381, 1178, 387, 347, 304, 305],
    ),
    (
        "<|system|>\nYou are helpful.<|end|>\n<|user|>\nWhat is 2+2?<|end|>\n<|assistant|>\n",
        &[
            1, 3256, 327, 300, 378, 422, 935, 264, 3259, 3257, 1663, 376, 319, 388, 46, 267, 276,
            3259, 3258,
        ],
        &[
            1, 3256, 300, 378, 422, 935, 264, 3259, 3257, 299, 308, 371, 376, 319, 388, 46, 267,
            276, 3259, 3258,
        ],
    ),
];
const CHAT_IDS_TF4: [&[u32]; 2] = [
    &[
        1, 3256, 327, 300, 378, 422, 328, 356, 397, 264, 3259, 3257, 474, 305, 370, 641, 264, 1663,
        376, 319, 388, 46, 267, 276, 3259, 3258, 588, 320, 376, 319, 1354, 3259, 3258,
    ],
    &[
        1, 3257, 583, 309, 3259, 3258, 583, 392, 444, 331, 334, 36, 3259, 3257, 350, 392, 312, 338,
        305, 373, 327, 310, 531, 305, 264, 3259, 3258,
    ],
];
const CHAT_IDS_TF5: [&[u32]; 2] = [
    &[
        1, 3256, 300, 378, 422, 328, 356, 397, 264, 3259, 3257, 278, 305, 370, 641, 264, 1663, 376,
        319, 388, 46, 267, 276, 3259, 3258, 285, 320, 376, 319, 1354, 3259, 3258,
    ],
    &[
        1, 3257, 284, 309, 3259, 3258, 284, 392, 444, 331, 334, 36, 3259, 3257, 296, 392, 312, 338,
        305, 373, 327, 310, 531, 305, 264, 3259, 3258,
    ],
];

#[test]
fn llama2_ids_are_transformers_4_and_5s() {
    let (tf4, tf5) = both();
    assert_eq!(
        tf4.dialects(),
        [Dialect::Transformers4, Dialect::Transformers5Rebuilt]
    );
    assert_eq!(tf4.fast_path(), Some("sentencepiece"));
    assert_eq!(tf5.fast_path(), Some("sentencepiece"));
    let mut differing = 0;
    for (text, ids4, ids5) in VECTORS {
        assert_eq!(tf4.encode(text, true).expect("tf4"), *ids4, "tf4 {text:?}");
        assert_eq!(tf5.encode(text, true).expect("tf5"), *ids5, "tf5 {text:?}");
        assert_eq!(
            tf4.encode(text, false).expect("tf4"),
            ids4[1..],
            "tf4 {text:?}"
        );
        assert_eq!(
            tf5.encode(text, false).expect("tf5"),
            ids5[1..],
            "tf5 {text:?}"
        );
        differing += usize::from(ids4 != ids5);
    }
    assert_eq!(differing, 19, "the rows tell the dialects apart");
    // Chats through `apply_chat_template(tokenize=True, add_generation_prompt=True)`.
    let chats = [
        vec![
            ChatMessage::new("system", "You are terse."),
            ChatMessage::new("user", "Be brief. What is 2+2?"),
            ChatMessage::new("assistant", "It is 4."),
        ],
        vec![
            ChatMessage::new("user", "Hi"),
            ChatMessage::new("assistant", " Hello there!"),
            ChatMessage::new("user", "\n  Tell me a joke."),
        ],
    ];
    let extras = ChatExtras::default();
    for (i, chat) in chats.iter().enumerate() {
        assert_eq!(
            tf4.encode_chat(chat, true, &extras).expect("tf4"),
            CHAT_IDS_TF4[i]
        );
        assert_eq!(
            tf5.encode_chat(chat, true, &extras).expect("tf5"),
            CHAT_IDS_TF5[i]
        );
    }
}

/// Words of the training corpus, chat tokens and the text where the dialects part.
const PIECES: &[&str] = &[
    " ",
    "  ",
    "\t",
    "\n",
    " \n",
    "▁",
    "the",
    "cache",
    "router",
    "Hello",
    "world",
    "Be",
    "brief.",
    "2+2?",
    "é",
    "日本語",
    "🙂",
    "👨‍👩‍👧",
    "<|system|>",
    "<|user|>",
    "<|assistant|>",
    "<|end|>",
    "<s>",
    "</s>",
    "<unk>",
    "<|",
    "|>",
];

fn text() -> impl Strategy<Value = String> {
    let pieces =
        prop::collection::vec(prop::sample::select(PIECES), 0..40).prop_map(|p| p.concat());
    prop_oneof![pieces, any::<String>()]
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    #[test]
    fn llama2_fast_paths_equal_their_full_pipelines(text in text()) {
        thread_local! {
            static TOKS: (ModelTokenizer, ModelTokenizer) = both();
        }
        TOKS.with(|(tf4, tf5)| {
            for tok in [tf4, tf5] {
                for add_special_tokens in [false, true] {
                    prop_assert_eq!(
                        tok.encode(&text, add_special_tokens).expect("fast"),
                        tok.encode_reference(&text, add_special_tokens).expect("full"),
                        "{} {:?}", tok.dialect(), text
                    );
                }
            }
            Ok(())
        })?;
    }
}
