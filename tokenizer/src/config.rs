//! What transformers takes from `tokenizer_config.json` besides the template: special tokens
//! (strings or `AddedToken` objects), tokens it registers when tokenizer.json lacks them, the
//! `add_bos_token`/`add_eos_token` flags that rebuild transformers 4's post-processor, and the
//! `chat_template` field in its string or named-list form.

use std::collections::BTreeMap;

use serde_json::Value as Json;
use tokenizers::processors::template::TemplateProcessing;

use super::TokenizerError;

/// Special-token attributes transformers puts in a template's context (`special_tokens_map`).
pub(super) const SPECIAL_TOKEN_KEYS: [&str; 7] = [
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
];

pub(super) fn parse_config(bytes: &[u8]) -> Result<serde_json::Map<String, Json>, TokenizerError> {
    match serde_json::from_slice::<Json>(bytes) {
        Ok(Json::Object(map)) => Ok(map),
        Ok(_) => Err(TokenizerError::InvalidConfig(
            "expected a JSON object".to_owned(),
        )),
        Err(e) => Err(TokenizerError::InvalidConfig(e.to_string())),
    }
}

/// transformers adds the config's `added_tokens_decoder` entries and its special tokens to the
/// tokenizer when tokenizer.json lacks them, which makes them atomic in text (and appends a new
/// id for a token the vocabulary does not have). Doing the same keeps such configs' ids equal.
pub(super) fn register_config_tokens(
    tokenizer: &mut tokenizers::Tokenizer,
    config: &serde_json::Map<String, Json>,
    special_tokens: &BTreeMap<String, String>,
    additional_special_tokens: &[String],
) -> Result<(), TokenizerError> {
    let mut known: std::collections::HashSet<String> = tokenizer
        .get_added_tokens_decoder()
        .into_values()
        .map(|t| t.content)
        .collect();
    let mut to_add = Vec::new();
    if let Some(Json::Object(decoder)) = config.get("added_tokens_decoder") {
        let mut entries: Vec<(u64, &serde_json::Map<String, Json>)> = decoder
            .iter()
            .filter_map(|(id, entry)| Some((id.parse().ok()?, entry.as_object()?)))
            .collect();
        entries.sort_by_key(|(id, _)| *id);
        for (_, entry) in entries {
            let Some(content) = entry.get("content").and_then(Json::as_str) else {
                continue;
            };
            if !known.insert(content.to_owned()) {
                continue;
            }
            let flag = |key: &str| entry.get(key).and_then(Json::as_bool);
            let special = flag("special").unwrap_or(false);
            to_add.push(
                tokenizers::AddedToken::from(content, special)
                    .single_word(flag("single_word").unwrap_or(false))
                    .lstrip(flag("lstrip").unwrap_or(false))
                    .rstrip(flag("rstrip").unwrap_or(false))
                    .normalized(flag("normalized").unwrap_or(!special)),
            );
        }
    }
    for content in special_tokens.values().chain(additional_special_tokens) {
        if known.insert(content.clone()) {
            to_add.push(tokenizers::AddedToken::from(content.as_str(), true));
        }
    }
    if !to_add.is_empty() {
        tokenizer
            .add_tokens(to_add)
            .map_err(|e| TokenizerError::InvalidConfig(format!("adding config tokens: {e}")))?;
    }
    Ok(())
}

/// Tokenizer classes whose transformers 4.x fast tokenizer rebuilds the post-processor from
/// `add_bos_token` / `add_eos_token` when it loads, with the class's defaults for absent flags.
/// transformers 5 ignores these flags whenever tokenizer.json exists, so only
/// [`Dialect::Transformers4`](super::Dialect::Transformers4) applies them.
const REBUILDING_CLASSES: [(&str, bool, bool); 5] = [
    ("LlamaTokenizer", true, false),
    ("CodeLlamaTokenizer", true, false),
    ("GemmaTokenizer", true, false),
    ("CohereTokenizer", true, false),
    ("GPTNeoXTokenizer", false, false),
];

/// For the classes above, the post-processor transformers 4 builds from the `add_bos_token` /
/// `add_eos_token` flags (or the class defaults), which then — not tokenizer.json's
/// post-processor — decides whether a completion gets BOS/EOS; e.g. a Llama tokenizer whose
/// config omits `add_bos_token` gets a BOS even if tokenizer.json adds none. `None` for other
/// classes: they keep tokenizer.json's post-processor whatever the flags say.
pub(super) fn bos_eos_processor(
    tokenizer: &tokenizers::Tokenizer,
    config: &serde_json::Map<String, Json>,
    special_tokens: &BTreeMap<String, String>,
) -> Result<Option<TemplateProcessing>, TokenizerError> {
    let class = config
        .get("tokenizer_class")
        .and_then(Json::as_str)
        .unwrap_or_default();
    let class = class.strip_suffix("Fast").unwrap_or(class);
    let Some(&(_, default_bos, default_eos)) = REBUILDING_CLASSES
        .iter()
        .find(|(name, _, _)| *name == class)
    else {
        return Ok(None);
    };
    let flag =
        |key: &str, default: bool| config.get(key).and_then(Json::as_bool).unwrap_or(default);
    // A flag whose token the config does not name adds nothing (transformers would fall back to
    // the class's default token text; configs in practice always name them).
    let token = |wanted: bool, key: &str| -> Result<Option<(String, u32)>, TokenizerError> {
        let Some(content) = special_tokens.get(key).filter(|_| wanted) else {
            return Ok(None);
        };
        match tokenizer.token_to_id(content) {
            Some(id) => Ok(Some((content.clone(), id))),
            None => Err(TokenizerError::InvalidConfig(format!(
                "{key} {content:?} is not in the vocabulary"
            ))),
        }
    };
    let bos = token(flag("add_bos_token", default_bos), "bos_token")?;
    let eos = token(flag("add_eos_token", default_eos), "eos_token")?;
    let piece = |t: &Option<(String, u32)>, type_id: u8| {
        t.as_ref()
            .map(|(content, _)| format!("{content}:{type_id}"))
    };
    let join =
        |parts: Vec<Option<String>>| parts.into_iter().flatten().collect::<Vec<_>>().join(" ");
    let single = join(vec![
        piece(&bos, 0),
        Some("$A:0".to_owned()),
        piece(&eos, 0),
    ]);
    let pair = join(vec![
        Some(single.clone()),
        piece(&bos, 1),
        Some("$B:1".to_owned()),
        piece(&eos, 1),
    ]);
    let invalid = |e: String| TokenizerError::InvalidConfig(format!("bos/eos post-processor: {e}"));
    let processor = TemplateProcessing::builder()
        .try_single(single)
        .map_err(invalid)?
        .try_pair(pair)
        .map_err(invalid)?
        .special_tokens(bos.into_iter().chain(eos).collect::<Vec<_>>())
        .build()
        .map_err(|e| invalid(e.to_string()))?;
    Ok(Some(processor))
}

/// A special token in tokenizer_config.json is a string or an `AddedToken` object.
pub(super) fn token_content(value: &Json) -> Option<String> {
    match value {
        Json::String(s) => Some(s.clone()),
        Json::Object(map) => map.get("content").and_then(Json::as_str).map(str::to_owned),
        _ => None,
    }
}

/// `chat_template` is a string, or a list of named templates of which transformers uses
/// `default` unless told otherwise.
pub(super) fn config_chat_template(
    config: &serde_json::Map<String, Json>,
) -> Result<Option<String>, TokenizerError> {
    match config.get("chat_template") {
        None | Some(Json::Null) => Ok(None),
        Some(Json::String(s)) => Ok(Some(s.clone())),
        Some(Json::Array(named)) => {
            for entry in named {
                if entry.get("name").and_then(Json::as_str) == Some("default") {
                    return match entry.get("template").and_then(Json::as_str) {
                        Some(s) => Ok(Some(s.to_owned())),
                        None => Err(TokenizerError::InvalidConfig(
                            "named chat template `default` has no `template` string".to_owned(),
                        )),
                    };
                }
            }
            Ok(None)
        }
        Some(_) => Err(TokenizerError::InvalidConfig(
            "`chat_template` must be a string or a list of named templates".to_owned(),
        )),
    }
}
