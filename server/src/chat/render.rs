//! Printing a streamed answer: content as it comes, reasoning dimmed (ANSI) on a terminal, and the
//! deltas of `/v1/chat/completions` events picked apart.

use serde_json::Value;
use std::io::Write;

const DIM: &str = "\x1b[2m";
const RESET: &str = "\x1b[0m";

/// What one streamed chat event carries.
#[derive(Debug, PartialEq)]
pub enum Delta {
    Reasoning(String),
    Content(String),
    Error(String),
}

/// The pieces of one `data:` payload of a chat completion stream, in order.
pub fn deltas(event: &Value) -> Vec<Delta> {
    if let Some(e) = event.get("error") {
        let msg = e["message"]
            .as_str()
            .or_else(|| e.as_str())
            .map(str::to_string)
            .unwrap_or_else(|| e.to_string());
        return vec![Delta::Error(msg)];
    }
    let delta = &event["choices"][0]["delta"];
    let mut out = Vec::new();
    if let Some(r) = delta["reasoning_content"].as_str().filter(|s| !s.is_empty()) {
        out.push(Delta::Reasoning(r.to_string()));
    }
    if let Some(c) = delta["content"].as_str().filter(|s| !s.is_empty()) {
        out.push(Delta::Content(c.to_string()));
    }
    out
}

/// Writes an answer piece by piece; dimmed reasoning when `color`, else reasoning between plain markers.
pub struct AnswerPrinter<W: Write> {
    out: W,
    color: bool,
    in_reasoning: bool,
    pub content: String,
}

impl<W: Write> AnswerPrinter<W> {
    pub fn new(out: W, color: bool) -> AnswerPrinter<W> {
        AnswerPrinter {
            out,
            color,
            in_reasoning: false,
            content: String::new(),
        }
    }

    pub fn reasoning(&mut self, text: &str) {
        if !self.in_reasoning {
            self.in_reasoning = true;
            let _ = write!(self.out, "{}", if self.color { DIM } else { "[thinking] " });
        }
        let _ = write!(self.out, "{text}");
        let _ = self.out.flush();
    }

    pub fn content(&mut self, text: &str) {
        self.end_reasoning();
        self.content.push_str(text);
        let _ = write!(self.out, "{text}");
        let _ = self.out.flush();
    }

    fn end_reasoning(&mut self) {
        if self.in_reasoning {
            self.in_reasoning = false;
            let _ = writeln!(self.out, "{}", if self.color { RESET } else { " [/thinking]" });
        }
    }

    /// Ends the answer's line (and any dimming).
    pub fn finish(mut self) -> (W, String) {
        self.end_reasoning();
        let _ = writeln!(self.out);
        let _ = self.out.flush();
        (self.out, self.content)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn reasoning_is_dimmed_and_content_is_kept() {
        let events = [
            json!({"choices":[{"delta":{"role":"assistant"}}]}),
            json!({"choices":[{"delta":{"reasoning_content":"let me see"}}]}),
            json!({"choices":[{"delta":{"reasoning_content":" more"}}]}),
            json!({"choices":[{"delta":{"content":"Hello"}}]}),
            json!({"choices":[{"delta":{"content":" world"}}]}),
        ];
        let mut p = AnswerPrinter::new(Vec::new(), true);
        for e in &events {
            for d in deltas(e) {
                match d {
                    Delta::Reasoning(t) => p.reasoning(&t),
                    Delta::Content(t) => p.content(&t),
                    Delta::Error(m) => panic!("unexpected error {m}"),
                }
            }
        }
        let (out, content) = p.finish();
        assert_eq!(content, "Hello world");
        assert_eq!(
            String::from_utf8(out).unwrap(),
            "\x1b[2mlet me see more\x1b[0m\nHello world\n"
        );
    }

    #[test]
    fn plain_output_marks_reasoning_without_escapes() {
        let mut p = AnswerPrinter::new(Vec::new(), false);
        p.reasoning("hmm");
        p.content("ok");
        let (out, _) = p.finish();
        assert_eq!(
            String::from_utf8(out).unwrap(),
            "[thinking] hmm [/thinking]\nok\n"
        );
    }

    #[test]
    fn an_error_event_is_an_error() {
        let d = deltas(&json!({"error":{"message":"engine died","type":"server_error"}}));
        assert_eq!(d, vec![Delta::Error("engine died".into())]);
    }
}
