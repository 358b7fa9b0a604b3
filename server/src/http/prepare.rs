//! Preparing a request's prompt (rendering the chat template, tokenizing) off the async runtime and,
//! where it can be, before the request takes the engine's lease.
//!
//! Rendering and tokenizing a large request take seconds of CPU: on the runtime they stalled every other
//! connection (`/health` took 19.8 s), and under the lease they stalled every generation. So they run
//! in `spawn_blocking`, at most [`TextWork`]'s permits at once (more wait their turn instead of taking
//! every core), and for the model in use before the lease; only when the request needs a switch (or its
//! model changed meanwhile) is the prompt prepared again under the lease, with the new model's text side.

use super::errors::{ApiError, Kind};
use super::AppState;
use crate::engine::supervisor::Lease;
use crate::model_text::{ChatInput, EncodeError, ModelText, RenderedChat, Resume};
use std::sync::Arc;
use tokio::sync::Semaphore;

/// The permits for text work off the runtime.
pub struct TextWork {
    slots: Semaphore,
}

impl TextWork {
    /// `n` preparations at once (at least one).
    pub fn new(n: usize) -> TextWork {
        TextWork {
            slots: Semaphore::new(n.max(1)),
        }
    }

    /// Half the cores: the engine computes on the same machine.
    pub fn for_this_machine() -> TextWork {
        let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
        TextWork::new(cores.div_ceil(2))
    }
}

/// Runs `work` on a blocking thread once a permit is free.
pub async fn off_runtime<T: Send + 'static>(
    state: &AppState,
    work: impl FnOnce() -> Result<T, ApiError> + Send + 'static,
) -> Result<T, ApiError> {
    let _permit = state
        .text_work
        .slots
        .acquire()
        .await
        .map_err(|_| ApiError::new(Kind::Internal, "the server is shutting down"))?;
    tokio::task::spawn_blocking(work)
        .await
        .map_err(|e| ApiError::new(Kind::Internal, format!("preparing the prompt failed: {e}")))?
}

/// The lease for `model` with `prepare`'s result for the lease's text side and context: prepared before
/// the lease when the model in use serves the request, else (or when the model changed meanwhile) under
/// it.
pub async fn leased_with<T: Send + 'static>(
    state: &AppState,
    model: Option<&str>,
    prepare: impl Fn(&ModelText, u32) -> Result<T, ApiError> + Send + Sync + 'static,
) -> Result<(Lease, T), ApiError> {
    let prepare = Arc::new(prepare);
    let early = match state.supervisor.text_for(model) {
        Some((text, n_ctx)) => {
            let (f, t) = (prepare.clone(), text.clone());
            Some((text, n_ctx, off_runtime(state, move || f(&t, n_ctx)).await?))
        }
        None => None,
    };
    let lease = state.supervisor.lease(model).await?;
    let text = lease.text();
    let n_ctx = lease.engine().ready().n_ctx;
    let prepared = match early {
        Some((t, c, p)) if Arc::ptr_eq(&t, &text) && c == n_ctx => p,
        _ => off_runtime(state, move || prepare(&text, n_ctx)).await?,
    };
    Ok((lease, prepared))
}

/// Refuses pictures for a model whose run config names no projector before its engine is taken, so
/// that such a request does not switch models only to be refused (the engine's READY decides for the
/// model that passes, [`crate::generate::Generation::start_in`]). A name that finds no model is left to
/// the lease to answer.
pub async fn refuse_pictures_early(
    state: &AppState,
    model: Option<&str>,
    chat: &ChatInput,
) -> Result<(), ApiError> {
    if chat.pictures.is_empty() {
        return Ok(());
    }
    let entries = state.supervisor.models().await;
    let name = match model.filter(|m| !m.is_empty()) {
        Some(m) => m.to_string(),
        None => match state.supervisor.current_id() {
            Some(id) => id,
            None => return Ok(()),
        },
    };
    match crate::registry::find_in(&entries, &name) {
        Ok(entry) if !entry.multimodal => Err(super::unsupported::text_only(
            Some(&entry.id),
            "pictures (its run config names no projector, `mmproj`)",
        )),
        _ => Ok(()),
    }
}

/// The `ApiError` of a prompt that cannot be tokenized.
pub fn encode_error(e: EncodeError) -> ApiError {
    match e {
        EncodeError::TooLong(m) => ApiError::bad_request(m),
        EncodeError::Failed(m) => {
            ApiError::new(Kind::Internal, format!("cannot tokenize the prompt: {m}"))
        }
    }
}

/// A chat request's prompt: the conversation rendered by the model's template, tokenized within `n_ctx`,
/// and the hints for resuming a kept conversation (the one preparation of the OpenAI and Anthropic chat
/// routes, run by [`leased_with`] off the runtime).
pub fn chat_prompt(
    text: &ModelText,
    chat: &ChatInput,
    n_ctx: u32,
) -> Result<(RenderedChat, Vec<u32>, Resume), ApiError> {
    let mut rendered = text
        .render_chat(chat)
        .map_err(|e| ApiError::bad_request(format!("cannot build the prompt: {e}")))?;
    if chat.pictures.is_empty() {
        let prompt = text.encode_chat(&rendered, n_ctx).map_err(encode_error)?;
        let resume = text.resume_hints(chat, &prompt);
        return Ok((rendered, prompt, resume));
    }
    let (prompt, places) = text
        .encode_chat_pictures(&rendered, n_ctx)
        .map_err(encode_error)?;
    // A mark typed in a message, or a template that drops or repeats message text, would put a
    // picture where none was sent or lose one: each picture must have exactly its place.
    if places.len() != chat.pictures.len() {
        return Err(ApiError::bad_request(format!(
            "the prompt has {} places for pictures and the request {} pictures (the chat template \
             dropped or repeated a message holding one, or a message holds the reserved character \
             U+E002)",
            places.len(),
            chat.pictures.len()
        )));
    }
    rendered.pictures = places
        .into_iter()
        .zip(&chat.pictures)
        .map(|(at, data)| poly_protocol::Picture {
            at: at as u32,
            data: data.clone(),
        })
        .collect();
    let resume = text.resume_hints(chat, &prompt);
    Ok((rendered, prompt, resume))
}
