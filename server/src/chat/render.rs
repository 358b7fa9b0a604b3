//! Printing a streamed answer: content as it comes, reasoning dimmed (ANSI) on a terminal, tool calls
//! on a line of their own.

use crate::client::ChatDelta;
use std::io::Write;

const DIM: &str = "\x1b[2m";
const RESET: &str = "\x1b[0m";

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

    /// Shows one piece of the stream.
    pub fn show(&mut self, delta: &ChatDelta) {
        match delta {
            ChatDelta::Reasoning(t) => self.reasoning(t),
            ChatDelta::Content(t) => self.content(t),
            ChatDelta::ToolCall { name, arguments } => {
                self.end_reasoning();
                let _ = writeln!(self.out, "[tool call {name}({arguments})]");
            }
            ChatDelta::Finished { .. } => {}
        }
    }

    fn reasoning(&mut self, text: &str) {
        if !self.in_reasoning {
            self.in_reasoning = true;
            let _ = write!(self.out, "{}", if self.color { DIM } else { "[thinking] " });
        }
        let _ = write!(self.out, "{text}");
        let _ = self.out.flush();
    }

    fn content(&mut self, text: &str) {
        self.end_reasoning();
        self.content.push_str(text);
        let _ = write!(self.out, "{text}");
        let _ = self.out.flush();
    }

    fn end_reasoning(&mut self) {
        if self.in_reasoning {
            self.in_reasoning = false;
            let _ = writeln!(
                self.out,
                "{}",
                if self.color { RESET } else { " [/thinking]" }
            );
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

    #[test]
    fn reasoning_is_dimmed_and_content_is_kept() {
        let stream = [
            ChatDelta::Reasoning("let me see".into()),
            ChatDelta::Reasoning(" more".into()),
            ChatDelta::Content("Hello".into()),
            ChatDelta::Content(" world".into()),
        ];
        let mut p = AnswerPrinter::new(Vec::new(), true);
        for d in &stream {
            p.show(d);
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
        p.show(&ChatDelta::Reasoning("hmm".into()));
        p.show(&ChatDelta::ToolCall {
            name: "get_weather".into(),
            arguments: r#"{"city":"Oslo"}"#.into(),
        });
        p.show(&ChatDelta::Content("ok".into()));
        let (out, content) = p.finish();
        assert_eq!(content, "ok");
        assert_eq!(
            String::from_utf8(out).unwrap(),
            "[thinking] hmm [/thinking]\n[tool call get_weather({\"city\":\"Oslo\"})]\nok\n"
        );
    }
}
