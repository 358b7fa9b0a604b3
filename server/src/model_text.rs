//! The text side of one loaded model as the HTTP layer uses it: its tokenizer directory, chat template,
//! end tokens and reply family, behind the few calls a request needs (render a chat, encode, decode
//! streamed tokens, parse the reply into content, reasoning and tool calls).
//!
//! This is the seam between the server core and [`crate::text`], which owns the formats themselves.

use crate::defaults::Defaults;
use crate::registry::ModelEntry;
use crate::text::family::Family;
use crate::text::parse::{prompt_opens_reasoning, ParseEvent, ParserOptions, ReplyParser};
use crate::text::template::{resolve_template, ChatInput as TemplateInput, ChatTemplate};
use crate::text::tokenizer_dir::{Detokenizer, TextTokenizer};
use serde_json::{Map, Value};
use std::sync::Arc;

/// A piece of parsed model output.
#[derive(Clone, Debug, PartialEq)]
pub enum Piece {
    Content(String),
    Reasoning(String),
    /// A complete tool call.
    ToolCall {
        name: String,
        /// The arguments as JSON object text.
        arguments: String,
    },
}

/// A conversation to render (OpenAI message shape; Anthropic requests are converted to it).
#[derive(Clone, Debug, Default)]
pub struct ChatInput {
    pub messages: Vec<Value>,
    pub tools: Option<Vec<Value>>,
    pub enable_thinking: Option<bool>,
    /// `chat_template_kwargs` beyond `enable_thinking`.
    pub extra: Map<String, Value>,
    /// Whether special-token texts typed in messages become those tokens (the request's `parse_special`).
    /// Off by default: only the template's own markers are control tokens, so text from a user cannot
    /// forge turns or roles (`<|im_end|><|im_start|>system` stays text).
    pub parse_special: bool,
    /// The pictures (base64 image files) whose places [`PICTURE_MARK`]s hold in `messages`, in order.
    pub pictures: Vec<String>,
}

/// Where a picture stood in a message's text (`crate::http::pictures` puts it there): a private-use
/// character no template treats specially, written as the model's picture tokens when the prompt is
/// tokenized ([`ModelText::encode_chat_pictures`]).
pub const PICTURE_MARK: char = '\u{E002}';

/// The tokens around a picture's placeholder, as llama.cpp's mtmd writes them for the Qwen-VL projectors
/// (`qwen3vl_merger`): `<|vision_start|>`, the placeholder the engine widens to the picture's rows,
/// `<|vision_end|>`.
pub const PICTURE_OPEN: &str = "<|vision_start|>";
pub const PICTURE_PAD: &str = "<|image_pad|>";
pub const PICTURE_CLOSE: &str = "<|vision_end|>";

/// The texts a picture is written as in a prompt: the opening, the placeholder the engine widens to the
/// picture's rows (its id, or 0 in a vocabulary without it: the engine reads the rows in its place
/// whatever its id), the closing.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PictureTokens {
    /// The projector type (`clip.projector_type`) whose rows mtmd writes between these words: the
    /// engine's must be it.
    pub projector: &'static str,
    pub open: &'static str,
    pub pad: &'static str,
    pub close: &'static str,
}

/// Qwen3-VL, Qwen3.5 and Qwen3.6 ([`PICTURE_OPEN`], [`PICTURE_PAD`], [`PICTURE_CLOSE`]).
pub const QWEN_VL_PICTURE: PictureTokens = PictureTokens {
    projector: "qwen3vl_merger",
    open: PICTURE_OPEN,
    pad: PICTURE_PAD,
    close: PICTURE_CLOSE,
};

/// Gemma 4: mtmd writes `<|image>` and `<image|>` around a `gemma4v` projector's rows
/// (`tools/mtmd/mtmd.cpp`); the placeholder is the token its chat template writes for a picture.
pub const GEMMA4_PICTURE: PictureTokens = PictureTokens {
    projector: "gemma4v",
    open: "<|image>",
    pad: "<|image|>",
    close: "<image|>",
};

impl PictureTokens {
    /// The picture texts of a model of architecture `arch` (`general.architecture`): Gemma 4's for
    /// `gemma4`, else Qwen-VL's (the other family the engine reads pictures into).
    pub fn for_architecture(arch: &str) -> PictureTokens {
        match arch {
            "gemma4" => GEMMA4_PICTURE,
            _ => QWEN_VL_PICTURE,
        }
    }
}

/// A rendered chat prompt and how the reply must be read.
#[derive(Clone, Debug)]
pub struct RenderedChat {
    pub prompt: String,
    /// Byte ranges of `prompt`, in order, that are message text holding special-token texts: they are
    /// tokenized as plain text ([`ModelText::encode_chat`]).
    pub literal: Vec<std::ops::Range<usize>>,
    pub parser: ParserSetup,
    /// The GEN's pictures at their placeholders, once the prompt is tokenized
    /// ([`crate::http::prepare::chat_prompt`]); empty for a text chat.
    pub pictures: Vec<poly_protocol::Picture>,
}

/// Where message text lies in a rendered prompt: a message string that holds a special-token text is
/// rendered again as a placeholder of private-use characters (which no template treats specially), so
/// the skeleton shows where each such string landed. The placeholder `\u{E000}N\u{E001}` stands for the
/// N-th string.
const HOLE_OPEN: char = '\u{E000}';
const HOLE_CLOSE: char = '\u{E001}';

/// Where the engine keeps a chat's state between turns (the protocol's `conversation` and
/// `checkpoint_at`; see [`ModelText::resume_hints`]).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Resume {
    pub conversation: Option<String>,
    pub checkpoint_at: Option<u32>,
}

/// How to parse a chat reply: its tools and whether the prompt left it inside reasoning.
#[derive(Clone, Debug, Default)]
pub struct ParserSetup {
    pub tools: Vec<Value>,
    pub starts_in_reasoning: bool,
}

/// The text side of a loaded model.
#[derive(Debug)]
pub struct ModelText {
    tokenizer: Arc<TextTokenizer>,
    /// `Err(reason)` when the model has no chat template: chat requests are refused, completions work.
    template: Result<ChatTemplate, String>,
    family: Family,
    /// The longest token in bytes ([`TextTokenizer::max_piece_len`]).
    max_piece_len: usize,
    /// Finds special-token texts (control, user-defined) in message text.
    specials: Option<aho_corasick::AhoCorasick>,
    /// The template's source as loaded (`/props` shows it).
    template_source: Option<String>,
    /// The model's sampling defaults and default answer lengths.
    defaults: Defaults,
    /// How a picture is written in a prompt ([`PictureTokens::for_architecture`]).
    picture_tokens: PictureTokens,
}

/// Why a prompt could not be tokenized within its context.
#[derive(Clone, Debug, PartialEq)]
pub enum EncodeError {
    /// The text cannot fit in the context (the request is wrong).
    TooLong(String),
    /// The tokenizer failed.
    Failed(String),
}

/// Texts above this are counted in pieces of about this size before the whole is tokenized: the
/// tokenizer's memory grows with the tokens it makes (hundreds of bytes each), so a text that may be far
/// over the context is refused before it is tokenized whole.
const COUNT_PIECE_BYTES: usize = 256 << 10;
/// Tokens a cut between two counted pieces may add or remove (a merge across the cut); a count over the
/// context by more than this per cut cannot fit.
const CUT_SLACK_TOKENS: usize = 8;

impl ModelText {
    /// Loads the model's tokenizer directory and template (the run config's `chat_template` names a
    /// family template or holds Jinja source; else the GGUF's), and its reply family (the run config's
    /// `family`, else the tokenizer config's).
    pub fn load(entry: &ModelEntry) -> Result<ModelText, String> {
        let config = entry
            .config
            .as_ref()
            .ok_or_else(|| format!("model {} has no run config", entry.id))?;
        let dir = config
            .tokenizer
            .as_ref()
            .ok_or_else(|| "the run config names no tokenizer directory".to_string())?;
        let tokenizer = TextTokenizer::load(dir).map_err(|e| e.to_string())?;
        let source = resolve_template(
            tokenizer.chat_template.as_deref(),
            config.chat_template.as_deref(),
        );
        let bos = tokenizer
            .config
            .bos
            .as_ref()
            .map(|t| t.text.clone())
            .unwrap_or_default();
        let eos = tokenizer
            .config
            .eos
            .as_ref()
            .map(|t| t.text.clone())
            .unwrap_or_default();
        let template_source = source.clone();
        let template = match source {
            Some(src) => ChatTemplate::new(&src, &bos, &eos).map_err(|e| e.to_string()),
            None => Err(format!(
                "model {} has no chat template (its GGUF has none and its run config names none); use /v1/completions",
                entry.id
            )),
        };
        if let Err(problem) = &template {
            eprintln!("polystrata: {problem}");
        }
        let family = config
            .raw
            .get("family")
            .and_then(Value::as_str)
            .and_then(Family::from_name)
            .unwrap_or(tokenizer.config.family);
        let max_piece_len = tokenizer.max_piece_len();
        let specials = special_finder(&tokenizer);
        let gguf = config.model_path().or_else(|| entry.path.clone());
        let defaults = Defaults::for_model(
            &config.sampling,
            gguf.as_deref(),
            &tokenizer.config.architecture,
        );
        let picture_tokens = PictureTokens::for_architecture(&tokenizer.config.architecture);
        Ok(ModelText {
            picture_tokens,
            tokenizer: Arc::new(tokenizer),
            template,
            family,
            max_piece_len,
            specials,
            template_source,
            defaults,
        })
    }

    /// How the model's pictures are written in a prompt.
    pub fn picture_tokens(&self) -> PictureTokens {
        self.picture_tokens
    }

    /// The model's sampling defaults and default answer lengths.
    pub fn defaults(&self) -> &Defaults {
        &self.defaults
    }

    /// The chat template's source (`None` when the model has none).
    pub fn template_source(&self) -> Option<&str> {
        self.template.as_ref().ok()?;
        self.template_source.as_deref()
    }

    /// The reply format's name ([`Family::name`]).
    pub fn family_name(&self) -> &'static str {
        self.family.name()
    }

    /// The BOS and EOS tokens' texts.
    pub fn bos_eos(&self) -> (Option<String>, Option<String>) {
        let c = &self.tokenizer.config;
        (
            c.bos.as_ref().map(|t| t.text.clone()),
            c.eos.as_ref().map(|t| t.text.clone()),
        )
    }

    /// The vocabulary's size.
    pub fn n_vocab(&self) -> usize {
        self.tokenizer.n_vocab()
    }

    /// llama-server's `/tokenize`: `text`'s ids, with the model's BOS when `add_special`, special-token
    /// texts read as the tokens when `parse_special`.
    pub fn tokenize(
        &self,
        text: &str,
        add_special: bool,
        parse_special: bool,
    ) -> Result<Vec<u32>, String> {
        self.tokenizer
            .encode(text, add_special, parse_special)
            .map_err(|e| e.to_string())
    }

    /// llama-server's `/detokenize`: the text of `ids`, special tokens written out (ids outside the
    /// vocabulary must be refused first).
    pub fn detokenize(&self, ids: &[u32]) -> String {
        self.tokenizer.decode(ids, true)
    }

    /// The prompt of a conversation, ending with the assistant's turn opened.
    pub fn render_chat(&self, input: &ChatInput) -> Result<RenderedChat, String> {
        let (prompt, literal) = self.render_marked(input, true)?;
        let starts_in_reasoning = prompt_opens_reasoning(self.family, &prompt);
        Ok(RenderedChat {
            prompt,
            literal,
            parser: ParserSetup {
                tools: input.tools.clone().unwrap_or_default(),
                starts_in_reasoning,
            },
            pictures: Vec::new(),
        })
    }

    fn render_with(
        &self,
        messages: Vec<Value>,
        input: &ChatInput,
        add_generation_prompt: bool,
    ) -> Result<String, String> {
        let template = self.template.as_ref().map_err(Clone::clone)?;
        template
            .render(
                &TemplateInput {
                    messages,
                    tools: input.tools.clone().unwrap_or_default(),
                    add_generation_prompt,
                    enable_thinking: input.enable_thinking,
                    extra: input.extra.clone(),
                    now: None,
                },
                self.tokenizer.config.add_bos,
            )
            .map_err(|e| e.to_string())
    }

    /// The rendered prompt and where the message strings that hold special-token texts lie in it (none
    /// when no message holds one, or when the request asked for `parse_special`). A template that
    /// changes such a string (so that it cannot be found again) is refused rather than guessed at.
    fn render_marked(
        &self,
        input: &ChatInput,
        add_generation_prompt: bool,
    ) -> Result<(String, Vec<std::ops::Range<usize>>), String> {
        let prompt = self.render_with(input.messages.clone(), input, add_generation_prompt)?;
        let Some(finder) = self.specials.as_ref().filter(|_| !input.parse_special) else {
            return Ok((prompt, Vec::new()));
        };
        let mut holes: Vec<String> = Vec::new();
        let mut skeleton = input.messages.clone();
        for message in &mut skeleton {
            punch_holes(message, finder, &mut holes);
        }
        if holes.is_empty() {
            return Ok((prompt, Vec::new()));
        }
        let skeleton = self.render_with(skeleton, input, add_generation_prompt)?;
        let (filled, literal) = fill_holes(&skeleton, &holes);
        if filled == prompt {
            return Ok((prompt, literal));
        }
        // Many templates trim message text (Gemma's, Llama 3's): the strings trimmed may fill the
        // skeleton exactly.
        let trimmed: Vec<String> = holes.iter().map(|h| h.trim().to_string()).collect();
        let (filled, literal) = fill_holes(&skeleton, &trimmed);
        if filled != prompt {
            let found = finder
                .find_iter(holes.concat().as_str())
                .next()
                .map(|m| holes.concat()[m.range()].to_string())
                .unwrap_or_default();
            return Err(format!(
                "a message holds the text of the control token {found:?}, and this model's template \
                 changes message text, so it cannot be kept as plain text; remove it, or send \
                 \"parse_special\": true to have it read as the token"
            ));
        }
        Ok((prompt, literal))
    }

    /// The ids of a rendered chat within `n_ctx`: the template's text with special-token texts read as
    /// those tokens, the ranges of `literal` as plain text.
    pub fn encode_chat(&self, chat: &RenderedChat, n_ctx: u32) -> Result<Vec<u32>, EncodeError> {
        if chat.literal.is_empty() {
            return self.encode_within(&chat.prompt, n_ctx);
        }
        self.check_size(&chat.prompt, n_ctx)?;
        self.encode_segments(&chat.prompt, &chat.literal)
            .map_err(EncodeError::Failed)
    }

    /// The ids of a rendered chat with pictures within `n_ctx`, as [`ModelText::encode_chat`], with each
    /// [`PICTURE_MARK`] written as the model's [`PictureTokens`]; and the placeholders' indices, in order.
    pub fn encode_chat_pictures(
        &self,
        chat: &RenderedChat,
        n_ctx: u32,
    ) -> Result<(Vec<u32>, Vec<usize>), EncodeError> {
        self.check_size(&chat.prompt, n_ctx)?;
        self.encode_marked(&chat.prompt, &chat.literal)
            .map_err(EncodeError::Failed)
    }

    /// [`ModelText::encode_segments`] with [`PICTURE_MARK`]s written as picture tokens: the ids and the
    /// placeholders' indices.
    fn encode_marked(
        &self,
        text: &str,
        literal: &[std::ops::Range<usize>],
    ) -> Result<(Vec<u32>, Vec<usize>), String> {
        let tok = &self.tokenizer;
        let err = |e: crate::text::TextError| e.to_string();
        let words = self.picture_tokens;
        let open = tok.encode(words.open, false, true).map_err(err)?;
        let close = tok.encode(words.close, false, true).map_err(err)?;
        let pad = tok.token_id(words.pad).unwrap_or(0);
        // The text as segments read with special-token texts as tokens, or (message text holding
        // them) as plain text.
        let mut segments = Vec::new();
        let mut at = 0;
        for r in literal {
            if r.start > at {
                segments.push((at..r.start, false));
            }
            segments.push((r.clone(), true));
            at = r.end;
        }
        if at < text.len() {
            segments.push((at..text.len(), false));
        }
        let config = &tok.config;
        let mut ids = Vec::new();
        let mut places = Vec::new();
        if config.add_bos {
            ids.extend(config.bos.as_ref().map(|t| t.id));
        }
        for (range, plain) in segments {
            for (k, piece) in text[range].split(PICTURE_MARK).enumerate() {
                if k > 0 {
                    ids.extend_from_slice(&open);
                    places.push(ids.len());
                    ids.push(pad);
                    ids.extend_from_slice(&close);
                }
                if !piece.is_empty() {
                    ids.extend(tok.encode(piece, false, !plain).map_err(err)?);
                }
            }
        }
        if config.add_eos {
            ids.extend(config.eos.as_ref().map(|t| t.id));
        }
        Ok((ids, places))
    }

    /// `text` tokenized in segments: the ranges of `literal` as plain text, the rest with special-token
    /// texts as tokens; BOS and EOS as the model adds them to a whole text.
    fn encode_segments(
        &self,
        text: &str,
        literal: &[std::ops::Range<usize>],
    ) -> Result<Vec<u32>, String> {
        let tok = &self.tokenizer;
        let err = |e: crate::text::TextError| e.to_string();
        let mut ids = Vec::new();
        let config = &tok.config;
        if config.add_bos {
            ids.extend(config.bos.as_ref().map(|t| t.id));
        }
        let mut at = 0;
        for r in literal {
            if r.start > at {
                ids.extend(tok.encode(&text[at..r.start], false, true).map_err(err)?);
            }
            ids.extend(tok.encode(&text[r.clone()], false, false).map_err(err)?);
            at = r.end;
        }
        if at < text.len() {
            ids.extend(tok.encode(&text[at..], false, true).map_err(err)?);
        }
        if config.add_eos {
            ids.extend(config.eos.as_ref().map(|t| t.id));
        }
        Ok(ids)
    }

    /// The engine's hints for a chat request whose prompt (ending with the assistant's turn opened) is
    /// `prompt`:
    /// - a conversation name from the chat's opening (the messages up to and including the first user
    ///   message): the requests of one chat share it, so two chats used in turn each keep their state in
    ///   the engine (parked in RAM) instead of each evicting the other;
    /// - a checkpoint where the assistant's turn opens (the end of the same conversation rendered without
    ///   the generation prompt): the next turn's prompt shares the text up to there, but templates drop
    ///   the reasoning of earlier answers, so it may depart right after; a model with recurrent layers can
    ///   only resume at a checkpoint.
    pub fn resume_hints(&self, input: &ChatInput, prompt: &[u32]) -> Resume {
        let opening = match input
            .messages
            .iter()
            .position(|m| m.get("role").and_then(Value::as_str) == Some("user"))
        {
            Some(i) => &input.messages[..=i],
            None => &input.messages[..],
        };
        let conversation = (!opening.is_empty()).then(|| {
            let mut text = Value::Array(opening.to_vec()).to_string();
            // The opening's pictures are marks in its text: two chats that open with other pictures are
            // two conversations (each kept), not one that the engine would read again.
            let shown = text.matches(PICTURE_MARK).count();
            for picture in input.pictures.iter().take(shown) {
                text.push_str(picture);
            }
            format!("chat-{:016x}", fnv1a64(text.as_bytes()))
        });
        Resume {
            conversation,
            checkpoint_at: self.turn_start(input, prompt).map(|n| n as u32),
        }
    }

    /// How many tokens of `prompt` come before the assistant's opened turn (`None` when that cannot be
    /// told, or when it is the whole prompt).
    fn turn_start(&self, input: &ChatInput, prompt: &[u32]) -> Option<usize> {
        let (without, literal) = self.render_marked(input, false).ok()?;
        let tokens = match input.pictures.is_empty() {
            true => self.encode_segments(&without, &literal).ok()?,
            false => self.encode_marked(&without, &literal).ok()?.0,
        };
        let shared = tokens
            .iter()
            .zip(prompt)
            .take_while(|(a, b)| a == b)
            .count();
        (shared > 0 && shared < prompt.len()).then_some(shared)
    }

    /// The ids of `text` with the model's BOS rule; special-token texts become those tokens (a rendered
    /// prompt holds them).
    pub fn encode(&self, text: &str) -> Result<Vec<u32>, String> {
        self.tokenizer
            .encode(text, true, true)
            .map_err(|e| e.to_string())
    }

    /// [`ModelText::encode`] for a prompt that must fit in `n_ctx` tokens, with memory bounded by the
    /// context instead of the text: a text longer than `n_ctx` times the longest token is refused
    /// without tokenizing; a long text is counted piece by piece (stopping once it is surely over)
    /// before it is tokenized whole. A prompt that is over by less than the counting can tell is left for
    /// the engine to refuse.
    pub fn encode_within(&self, text: &str, n_ctx: u32) -> Result<Vec<u32>, EncodeError> {
        self.check_size(text, n_ctx)?;
        self.encode(text).map_err(EncodeError::Failed)
    }

    /// [`ModelText::encode_within`]'s bounds: refuses a text that surely cannot fit in `n_ctx` tokens.
    fn check_size(&self, text: &str, n_ctx: u32) -> Result<(), EncodeError> {
        let n_ctx = n_ctx as usize;
        let too_long = |what: String| {
            EncodeError::TooLong(format!(
                "the prompt ({what}) is longer than the model's context of {n_ctx} tokens"
            ))
        };
        if text.len() > n_ctx.saturating_mul(self.max_piece_len) {
            return Err(too_long(format!("{} bytes", text.len())));
        }
        if text.len() > COUNT_PIECE_BYTES {
            let mut counted = 0usize;
            // `cuts`: the cuts before this piece's end.
            for (cuts, piece) in pieces_of(text, COUNT_PIECE_BYTES).enumerate() {
                counted += self
                    .tokenizer
                    .encode(piece, false, true)
                    .map_err(|e| EncodeError::Failed(e.to_string()))?
                    .len();
                if counted > n_ctx + cuts * CUT_SLACK_TOKENS {
                    return Err(too_long(format!("over {counted} tokens")));
                }
            }
        }
        Ok(())
    }

    /// Token `id` as text (for log-probabilities), special tokens included.
    pub fn token_piece(&self, id: u32) -> String {
        String::from_utf8_lossy(self.tokenizer.piece(id, true)).into_owned()
    }

    /// Token `id`'s bytes, special tokens written out.
    pub fn token_bytes(&self, id: u32) -> Vec<u8> {
        self.tokenizer.piece(id, true).to_vec()
    }

    /// A decoder for one reply's tokens.
    pub fn decoder(&self) -> Decoder {
        Decoder {
            tokenizer: self.tokenizer.clone(),
            inner: Detokenizer::new(),
        }
    }

    /// A parser for one chat reply.
    pub fn parser(&self, setup: ParserSetup) -> OutputParser {
        OutputParser {
            inner: ReplyParser::new(
                self.family,
                ParserOptions {
                    starts_in_reasoning: setup.starts_in_reasoning,
                    tools: setup.tools,
                },
            ),
            calls: Vec::new(),
        }
    }

    /// Tokens that end a reply (the tokenizer's end-of-generation set), beyond READY's `eos`.
    pub fn stop_tokens(&self) -> Vec<u32> {
        self.tokenizer
            .config
            .end_of_reply
            .iter()
            .map(|t| t.id)
            .collect()
    }
}

/// Turns generated token ids into text as it becomes complete (a character split over tokens waits).
pub struct Decoder {
    tokenizer: Arc<TextTokenizer>,
    inner: Detokenizer,
}

impl Decoder {
    /// The text token `id` completes (control tokens, such as an end-of-turn, give none).
    pub fn push(&mut self, id: u32) -> String {
        self.inner.push(&self.tokenizer, id, false)
    }

    /// What is still pending at the end of the reply.
    pub fn finish(&mut self) -> String {
        self.inner.finish()
    }
}

/// Splits a streamed chat reply into content, reasoning and whole tool calls.
pub struct OutputParser {
    inner: ReplyParser,
    /// Calls begun and not yet ended: (index, name, arguments).
    calls: Vec<(usize, String, String)>,
}

impl OutputParser {
    pub fn push(&mut self, text: &str) -> Vec<Piece> {
        let events = self.inner.feed(text);
        self.pieces(events)
    }

    pub fn finish(&mut self) -> Vec<Piece> {
        let events = self.inner.finish();
        self.pieces(events)
    }

    fn pieces(&mut self, events: Vec<ParseEvent>) -> Vec<Piece> {
        let mut out: Vec<Piece> = Vec::new();
        for event in events {
            match event {
                ParseEvent::Content(t) => match out.last_mut() {
                    Some(Piece::Content(prev)) => prev.push_str(&t),
                    _ => out.push(Piece::Content(t)),
                },
                ParseEvent::Reasoning(t) => match out.last_mut() {
                    Some(Piece::Reasoning(prev)) => prev.push_str(&t),
                    _ => out.push(Piece::Reasoning(t)),
                },
                ParseEvent::ToolCallStart { index, name } => {
                    self.calls.push((index, name, String::new()))
                }
                ParseEvent::ToolCallArgs { index, arguments } => {
                    if let Some(call) = self.calls.iter_mut().find(|c| c.0 == index) {
                        call.2.push_str(&arguments);
                    }
                }
                ParseEvent::ToolCallEnd { index } => {
                    if let Some(at) = self.calls.iter().position(|c| c.0 == index) {
                        let (_, name, arguments) = self.calls.remove(at);
                        let arguments = if arguments.trim().is_empty() {
                            "{}".to_string()
                        } else {
                            arguments
                        };
                        out.push(Piece::ToolCall { name, arguments });
                    }
                }
            }
        }
        out
    }
}

/// `text` in pieces of about `size` bytes, each cut after a newline (else a space, else any character)
/// so that few tokens straddle a cut.
fn pieces_of(text: &str, size: usize) -> impl Iterator<Item = &str> {
    let mut rest = text;
    std::iter::from_fn(move || {
        if rest.is_empty() {
            return None;
        }
        if rest.len() <= size {
            return Some(std::mem::take(&mut rest));
        }
        let mut end = size;
        while !rest.is_char_boundary(end) {
            end -= 1;
        }
        if end == 0 {
            // A character wider than `size`: it is one piece.
            end = rest.chars().next().map_or(rest.len(), char::len_utf8);
        }
        let window = &rest[..end];
        let cut = window
            .rfind('\n')
            .or_else(|| window.rfind(' '))
            .map(|i| i + 1)
            .filter(|&i| i > size / 2)
            .unwrap_or(end);
        let (piece, tail) = rest.split_at(cut);
        rest = tail;
        Some(piece)
    })
}

/// FNV-1a, 64 bits: a stable name for a chat's opening (not a security hash: a collision only makes two
/// chats share one kept state, which the engine handles by their common prefix).
fn fnv1a64(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325, |h, &b| {
        (h ^ u64::from(b)).wrapping_mul(0x0000_0100_0000_01b3)
    })
}

/// A matcher of the tokenizer's special-token texts (control and user-defined tokens, which the
/// tokenizer splits out of text), or `None` when it has none.
fn special_finder(tokenizer: &TextTokenizer) -> Option<aho_corasick::AhoCorasick> {
    let texts: Vec<&str> = tokenizer
        .config
        .special_tokens
        .iter()
        .map(|(t, _)| t.text.as_str())
        .filter(|t| !t.is_empty())
        .collect();
    if texts.is_empty() {
        return None;
    }
    aho_corasick::AhoCorasick::new(texts).ok()
}

/// Replaces every string of `message`'s text (its content, text parts, reasoning, name) that holds a
/// special-token text with a placeholder, keeping the string in `holes`.
fn punch_holes(message: &mut Value, finder: &aho_corasick::AhoCorasick, holes: &mut Vec<String>) {
    let Value::Object(fields) = message else {
        return;
    };
    for key in ["content", "reasoning_content", "name"] {
        match fields.get_mut(key) {
            Some(Value::String(text)) => punch(text, finder, holes),
            Some(Value::Array(parts)) => {
                for part in parts {
                    if let Some(Value::String(text)) = part.get_mut("text") {
                        punch(text, finder, holes);
                    }
                }
            }
            _ => {}
        }
    }
}

fn punch(text: &mut String, finder: &aho_corasick::AhoCorasick, holes: &mut Vec<String>) {
    if finder.is_match(text.as_str()) {
        let hole = format!("{HOLE_OPEN}{}{HOLE_CLOSE}", holes.len());
        holes.push(std::mem::replace(text, hole));
    }
}

/// The skeleton with each placeholder replaced by its string, and the ranges those strings took.
fn fill_holes(skeleton: &str, holes: &[String]) -> (String, Vec<std::ops::Range<usize>>) {
    let mut out =
        String::with_capacity(skeleton.len() + holes.iter().map(String::len).sum::<usize>());
    let mut ranges = Vec::new();
    let mut rest = skeleton;
    while let Some(open) = rest.find(HOLE_OPEN) {
        out.push_str(&rest[..open]);
        let after = &rest[open + HOLE_OPEN.len_utf8()..];
        let index = after
            .find(HOLE_CLOSE)
            .and_then(|close| after[..close].parse::<usize>().ok().map(|n| (n, close)));
        match index.and_then(|(n, close)| holes.get(n).map(|h| (h, close))) {
            Some((hole, close)) => {
                ranges.push(out.len()..out.len() + hole.len());
                out.push_str(hole);
                rest = &after[close + HOLE_CLOSE.len_utf8()..];
            }
            None => {
                // Not a placeholder of ours (a message's own private-use character): kept as is.
                out.push(HOLE_OPEN);
                rest = after;
            }
        }
    }
    out.push_str(rest);
    (out, ranges)
}

#[cfg(test)]
mod tests {
    #[test]
    fn pieces_cover_the_text_and_cut_at_newlines() {
        let text = "ab\ncd ef\ngh".repeat(100);
        let pieces: Vec<&str> = super::pieces_of(&text, 64).collect();
        assert_eq!(pieces.concat(), text);
        assert!(pieces.iter().all(|p| p.len() <= 64));
        assert!(pieces[..pieces.len() - 1].iter().all(|p| p.ends_with('\n')));
        let wide = "é".repeat(100);
        assert_eq!(super::pieces_of(&wide, 7).collect::<String>(), wide);
    }
}
