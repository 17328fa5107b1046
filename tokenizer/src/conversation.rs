//! vLLM's "conversation": how request messages become the `messages` a chat template sees --
//! text parts joined with newlines or kept as `{"type": "text"}` parts depending on the
//! template's content format, tool-call arguments parsed into objects, and only the fields vLLM
//! passes on.

use serde_json::Value as Json;

use super::{ChatMessage, ContentFormat, MessageContent, TokenizerError};

/// vLLM's "auto" content format: `openai` when the template iterates over a message's
/// `content` (`{% for part in message['content'] %}`), `string` otherwise. vLLM inspects the
/// Jinja AST; scanning the source for that loop shape covers the templates seen in practice.
pub(super) fn detect_content_format(source: &str) -> ContentFormat {
    let mut rest = source;
    while let Some(pos) = rest.find(" in ") {
        let before = &rest[..pos];
        let after = rest[pos + 4..].trim_start();
        rest = &rest[pos + 4..];
        let in_for = before
            .rfind("{%")
            .is_some_and(|open| before[open..].contains("for ") && !before[open..].contains("%}"));
        if !in_for {
            continue;
        }
        let ident_len = after
            .find(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
            .unwrap_or(after.len());
        if ident_len == 0 {
            continue;
        }
        let tail = &after[ident_len..];
        let accesses_content = tail.starts_with("['content']")
            || tail.starts_with("[\"content\"]")
            || (tail.starts_with(".content")
                && !tail[".content".len()..]
                    .starts_with(|c: char| c.is_ascii_alphanumeric() || c == '_'));
        if accesses_content {
            return ContentFormat::OpenAi;
        }
    }
    ContentFormat::String
}

/// Turns request messages into vLLM's conversation (`ConversationMessage` dicts).
pub(super) fn conversation(
    messages: &[ChatMessage],
    format: ContentFormat,
) -> Result<Vec<Json>, TokenizerError> {
    let wrap = format == ContentFormat::OpenAi;
    let mut out = Vec::with_capacity(messages.len());
    for (index, message) in messages.iter().enumerate() {
        let invalid = |reason: String| TokenizerError::InvalidMessage { index, reason };
        let texts: Vec<String> = match &message.content {
            None => Vec::new(),
            Some(MessageContent::Text(text)) => vec![text.clone()],
            Some(MessageContent::Parts(parts)) => {
                let mut texts = Vec::with_capacity(parts.len());
                for part in parts {
                    if let Some(text) = part_text(part).map_err(invalid)? {
                        texts.push(text);
                    }
                }
                texts
            }
        };
        let content = if wrap && message.role != "tool" {
            Json::Array(
                texts
                    .into_iter()
                    .map(|text| serde_json::json!({"type": "text", "text": text}))
                    .collect(),
            )
        } else {
            // String format joins text parts with "\n"; vLLM also flattens all-text `tool`
            // content to a string in openai format, because most templates expect one.
            Json::String(texts.join("\n"))
        };

        let mut msg = serde_json::Map::new();
        msg.insert("role".to_owned(), Json::String(message.role.clone()));
        msg.insert("content".to_owned(), content);
        if message.role == "assistant" {
            if let Some(calls) = &message.tool_calls
                && !calls.is_null()
            {
                let calls = normalize_tool_calls(calls.clone());
                if !matches!(&calls, Json::Array(items) if items.is_empty()) {
                    msg.insert("tool_calls".to_owned(), calls);
                }
            }
            if let Some(reasoning) = &message.reasoning {
                msg.insert("reasoning".to_owned(), Json::String(reasoning.clone()));
                msg.insert(
                    "reasoning_content".to_owned(),
                    Json::String(reasoning.clone()),
                );
            }
        } else if message.role == "tool"
            && let Some(id) = &message.tool_call_id
        {
            msg.insert("tool_call_id".to_owned(), Json::String(id.clone()));
        }
        if let Some(name) = &message.name {
            msg.insert("name".to_owned(), Json::String(name.clone()));
        }
        out.push(Json::Object(msg));
    }
    Ok(out)
}

/// The text of one content part, `None` for a text part whose text is null (vLLM skips those).
fn part_text(part: &Json) -> Result<Option<String>, String> {
    let obj = match part {
        Json::String(s) => return Ok(Some(s.clone())),
        Json::Object(obj) => obj,
        _ => return Err("content part is neither a string nor an object".to_owned()),
    };
    let kind = obj
        .get("type")
        .and_then(Json::as_str)
        .ok_or_else(|| "content part has no string `type`".to_owned())?;
    let key = match kind {
        "text" | "input_text" | "output_text" => "text",
        "refusal" => "refusal",
        "thinking" => "thinking",
        other => {
            // Media parts need the model's multimodal processor; the router has none and
            // cannot reproduce vLLM's placeholders, so it says so instead of guessing.
            return Err(format!("content part type `{other}` is not supported"));
        }
    };
    match obj.get(key) {
        None | Some(Json::Null) => Ok(None),
        Some(Json::String(s)) => Ok(Some(s.clone())),
        Some(_) => Err(format!("content part `{key}` is not a string")),
    }
}

/// vLLM parses string `function.arguments` into objects (invalid JSON becomes `{}`), because
/// tool-use templates expect dicts.
fn normalize_tool_calls(mut calls: Json) -> Json {
    if let Json::Array(items) = &mut calls {
        for item in items {
            if let Some(function) = item.get_mut("function").and_then(Json::as_object_mut) {
                let parsed = match function.get("arguments") {
                    Some(Json::String(s)) => serde_json::from_str::<Json>(s)
                        .unwrap_or_else(|_| Json::Object(serde_json::Map::new())),
                    Some(v @ (Json::Object(_) | Json::Array(_))) => v.clone(),
                    _ => Json::Object(serde_json::Map::new()),
                };
                function.insert("arguments".to_owned(), parsed);
            }
        }
    }
    calls
}

/// transformers' `continue_final_message`: keep the rendered text up to the end of the last
/// message's content (the last text part for list content), so the model continues it. Like
/// transformers, it looks for the whitespace-stripped content and keeps trailing whitespace only
/// when the template kept it.
pub(super) fn cut_after_final_message(
    rendered: String,
    message_count: usize,
    conversation: &[Json],
) -> Result<String, TokenizerError> {
    let missing = |reason: &str| TokenizerError::InvalidRequest(reason.to_owned());
    let last = conversation
        .last()
        .ok_or_else(|| missing("continue_final_message needs at least one message"))?;
    let final_text = match last.get("content") {
        Some(Json::String(s)) => s.as_str(),
        Some(Json::Array(parts)) => parts
            .iter()
            .rev()
            .find_map(|p| p.get("text").and_then(Json::as_str))
            .ok_or_else(|| missing("continue_final_message found no text to continue"))?,
        _ => return Err(missing("continue_final_message found no text to continue")),
    };
    let stripped = final_text.trim();
    let Some(at) = rendered.rfind(stripped) else {
        return Err(TokenizerError::InvalidMessage {
            index: message_count.saturating_sub(1),
            reason: "continue_final_message is set but the final message does not appear in the \
                     rendered chat"
                .to_owned(),
        });
    };
    // transformers compares `len(content.lstrip())` bytes with the whole content: only content
    // without leading whitespace, rendered verbatim, keeps its trailing whitespace.
    let left_stripped = final_text.trim_start();
    let verbatim =
        left_stripped.len() == final_text.len() && rendered[at..].starts_with(final_text);
    let end = if verbatim {
        at + left_stripped.len()
    } else {
        at + stripped.len()
    };
    let mut rendered = rendered;
    rendered.truncate(end);
    Ok(rendered)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn detects_openai_content_format() {
        assert_eq!(
            detect_content_format("{% for m in messages %}{{ m['content'] }}{% endfor %}"),
            ContentFormat::String
        );
        assert_eq!(
            detect_content_format(
                "{% for m in messages %}{% for p in m['content'] %}{{ p.text }}{% endfor %}{% endfor %}"
            ),
            ContentFormat::OpenAi
        );
        assert_eq!(
            detect_content_format("{%- for part in message.content -%}{%- endfor -%}"),
            ContentFormat::OpenAi
        );
        assert_eq!(
            detect_content_format("{% for x in message.contents %}{% endfor %}"),
            ContentFormat::String
        );
    }
}
