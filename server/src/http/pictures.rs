//! Pictures in chat requests: OpenAI `image_url` parts with `data:image/...;base64,` URLs, Anthropic
//! `image` blocks with a `base64` source, Ollama's `images`. Each picture is taken out of its message and
//! a mark ([`PICTURE_MARK`]) left in the message text where it stood; the chat template renders the text,
//! and the prompt's tokenizing puts the model's picture tokens where the mark landed
//! ([`crate::model_text::ModelText::encode_chat_pictures`]). The data goes to the engine as it came
//! (base64), checked here so that a bad one is a 400 before the engine is taken.
//!
//! Remote pictures (`http(s)://` URLs) are refused: the engine has no network access by design and the
//! server fetches nothing for a request.

use super::errors::ApiError;
use serde_json::{json, Value};

pub use crate::model_text::PICTURE_MARK;

/// The base64 data of a `data:` URL of an image, checked.
fn data_url(url: &str, what: &str) -> Result<String, ApiError> {
    let lower = url.get(..8).unwrap_or(url).to_ascii_lowercase();
    if lower.starts_with("http://") || lower.starts_with("https://") {
        return Err(ApiError::bad_request(format!(
            "{what}: pictures by URL are not fetched (the engine has no network access); send the \
             picture inline as a data:image/...;base64, URL"
        )));
    }
    let Some(rest) = url.strip_prefix("data:") else {
        return Err(ApiError::bad_request(format!(
            "{what}: the URL must be a data:image/...;base64, URL"
        )));
    };
    let Some((meta, data)) = rest.split_once(',') else {
        return Err(ApiError::bad_request(format!(
            "{what}: the data URL has no `,`"
        )));
    };
    let mut meta = meta.split(';');
    let mime = meta.next().unwrap_or("");
    if !mime.to_ascii_lowercase().starts_with("image/") {
        return Err(ApiError::bad_request(format!(
            "{what}: the data URL holds {mime:?}, not an image"
        )));
    }
    if !meta.any(|p| p.eq_ignore_ascii_case("base64")) {
        return Err(ApiError::bad_request(format!(
            "{what}: the data URL must be base64 (data:{mime};base64,...)"
        )));
    }
    checked(data, what)
}

/// `data` if it is base64 of something.
fn checked(data: &str, what: &str) -> Result<String, ApiError> {
    match poly_protocol::decode_base64(data) {
        Ok(bytes) if !bytes.is_empty() => Ok(data.to_string()),
        Ok(_) => Err(ApiError::bad_request(format!(
            "{what}: the picture is empty"
        ))),
        Err(e) => Err(ApiError::bad_request(format!("{what}: {e}"))),
    }
}

/// A text part holding the mark, in place of a picture part.
fn mark_part() -> Value {
    json!({"type": "text", "text": PICTURE_MARK.to_string()})
}

/// Takes the pictures out of OpenAI chat messages: each `image_url` part (`{"url": ...}` or the URL
/// itself) becomes a text part holding the mark, in order; the pictures' data in the same order. Audio
/// and file parts stay refused: the engine reads no sound or documents.
pub fn take_openai_pictures(
    messages: &mut [Value],
    model: Option<&str>,
) -> Result<Vec<String>, ApiError> {
    let mut pictures = Vec::new();
    for (i, m) in messages.iter_mut().enumerate() {
        let Some(Value::Array(parts)) = m.get_mut("content") else {
            continue;
        };
        for (j, part) in parts.iter_mut().enumerate() {
            let kind = part.get("type").and_then(Value::as_str).unwrap_or("");
            let what = format!("messages[{i}].content[{j}]");
            match kind {
                "image_url" => {
                    let url = match part.get("image_url") {
                        Some(Value::String(u)) => u.as_str(),
                        Some(v) => v.get("url").and_then(Value::as_str).unwrap_or(""),
                        None => "",
                    };
                    pictures.push(data_url(url, &what)?);
                    *part = mark_part();
                }
                "input_image" | "image" | "input_audio" | "audio" | "file" => {
                    return Err(super::unsupported::text_only(
                        model,
                        &format!("a content part of type {kind:?} ({what})"),
                    ))
                }
                _ => {}
            }
        }
    }
    Ok(pictures)
}

/// The data of an Anthropic `image` block (`source.type` `base64`; `url` sources are refused).
pub fn anthropic_picture(block: &Value, what: &str) -> Result<String, ApiError> {
    let source = block.get("source").unwrap_or(&Value::Null);
    match source.get("type").and_then(Value::as_str) {
        Some("base64") => {
            let mime = source
                .get("media_type")
                .and_then(Value::as_str)
                .unwrap_or("");
            if !mime.to_ascii_lowercase().starts_with("image/") {
                return Err(ApiError::bad_request(format!(
                    "{what}: media_type {mime:?} is not an image"
                )));
            }
            let data = source.get("data").and_then(Value::as_str).unwrap_or("");
            checked(data, what)
        }
        Some("url") => Err(ApiError::bad_request(format!(
            "{what}: pictures by URL are not fetched (the engine has no network access); send the \
             picture as a base64 source"
        ))),
        other => Err(ApiError::bad_request(format!(
            "{what}: an image source of type {other:?}; send {{\"type\": \"base64\", \"media_type\": \
             \"image/png\", \"data\": ...}}"
        ))),
    }
}

/// The pictures of an Ollama `images` list (base64 strings), checked; `what` names what holds the list
/// (a message, or "" for `/api/generate`'s body).
pub fn ollama_pictures(images: &Value, what: &str) -> Result<Vec<String>, ApiError> {
    let at = if what.is_empty() {
        "images".to_string()
    } else {
        format!("{what}.images")
    };
    match images {
        Value::Null => Ok(Vec::new()),
        Value::Array(list) => list
            .iter()
            .enumerate()
            .map(|(k, v)| match v.as_str() {
                Some(s) => checked(s, &format!("{at}[{k}]")),
                None => Err(ApiError::bad_request(format!(
                    "{at}[{k}] must be a base64 string"
                ))),
            })
            .collect(),
        _ => Err(ApiError::bad_request(format!("{at} must be an array"))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn image_parts_become_marks_and_remote_urls_are_refused() {
        let mut messages = vec![json!({"role": "user", "content": [
            {"type": "text", "text": "what is this?"},
            {"type": "image_url", "image_url": {"url": "data:image/png;base64,Zm9v"}},
            {"type": "image_url", "image_url": "data:image/jpeg;base64,YmFy"},
        ]})];
        let pictures = take_openai_pictures(&mut messages, None).expect("taken");
        assert_eq!(pictures, ["Zm9v", "YmFy"]);
        assert_eq!(messages[0]["content"][1], mark_part());
        assert_eq!(messages[0]["content"][2], mark_part());
        for (url, needle) in [
            ("https://example.com/cat.png", "not fetched"),
            ("HTTP://example.com/cat.png", "not fetched"),
            ("data:text/plain;base64,Zm9v", "not an image"),
            ("data:image/png,Zm9v", "base64"),
            ("data:image/png;base64,Zm9v!", "alphabet"),
            ("file:///etc/passwd", "data:image"),
        ] {
            let mut m = vec![json!({"role": "user", "content": [
                {"type": "image_url", "image_url": {"url": url}},
            ]})];
            let e = take_openai_pictures(&mut m, None).expect_err(url);
            assert!(e.message.contains(needle), "{url}: {}", e.message);
        }
        let mut audio = vec![json!({"role": "user", "content": [{"type": "input_audio"}]})];
        let e = take_openai_pictures(&mut audio, Some("m")).expect_err("audio");
        assert!(e.message.contains("text only"), "{}", e.message);
    }

    #[test]
    fn anthropic_and_ollama_pictures_are_checked() {
        let block = json!({"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "Zm9v"}});
        assert_eq!(anthropic_picture(&block, "b").expect("base64"), "Zm9v");
        let url = json!({"type": "image", "source": {"type": "url", "url": "https://x/y.png"}});
        assert!(anthropic_picture(&url, "b")
            .expect_err("url")
            .message
            .contains("not fetched"));
        assert_eq!(
            ollama_pictures(&json!(["Zm9v"]), "m").expect("ok"),
            ["Zm9v"]
        );
        assert!(ollama_pictures(&json!([1]), "m").is_err());
        assert!(ollama_pictures(&json!(["@@"]), "m").is_err());
    }
}
