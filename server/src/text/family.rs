//! Which reasoning and tool-call format a model writes, from its tokenizer's `pre` name, its chat
//! template and its architecture.
//!
//! The template decides first, with the markers llama.cpp's `common/chat.cpp` looks for (a template is
//! written for the format its model was trained on); the pre-tokenizer name and the architecture decide
//! for models whose template says nothing (our synthetic models, base models).

/// A reasoning / tool-call format.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Family {
    /// Qwen3, Qwen3.6, Ornith, Clover: `<think>…</think>`; `<tool_call>` holding either
    /// `<function=NAME><parameter=P>V</parameter></function>` or a JSON `{"name", "arguments"}`.
    Qwen3,
    /// GLM-4.5 and later: `<think>…</think>`; `<tool_call>NAME<arg_key>K</arg_key><arg_value>V</arg_value>…`.
    Glm,
    /// Gemma 4: `<|channel>thought…<channel|>`; `<|tool_call>call:NAME{key:value,…}<tool_call|>`.
    Gemma4,
    /// DeepSeek V3.2 / V4: `<think>…</think>`; DSML `invoke` / `parameter` blocks.
    DeepSeekV4,
    /// LFM2: `<think>…</think>`; `<|tool_call_start|>[NAME(K='V', …)]<|tool_call_end|>`.
    Lfm2,
    /// Anything else: `<think>…</think>` if it appears; tool calls as JSON `{"name", "arguments"}` inside
    /// `<tool_call>…</tool_call>` or a ```` ```json ```` fence.
    JsonWrapper,
}

impl Family {
    /// Every family.
    pub const ALL: [Family; 6] = [
        Family::Qwen3,
        Family::Glm,
        Family::Gemma4,
        Family::DeepSeekV4,
        Family::Lfm2,
        Family::JsonWrapper,
    ];

    /// The name written in tokenizer configs and run configs.
    pub fn name(self) -> &'static str {
        match self {
            Family::Qwen3 => "qwen3",
            Family::Glm => "glm",
            Family::Gemma4 => "gemma4",
            Family::DeepSeekV4 => "deepseek-v4",
            Family::Lfm2 => "lfm2",
            Family::JsonWrapper => "json",
        }
    }

    /// The family of a name written by [`Family::name`].
    pub fn from_name(name: &str) -> Option<Family> {
        Family::ALL.into_iter().find(|f| f.name() == name)
    }

    /// The family of a model: its template first, then its pre-tokenizer and architecture.
    pub fn detect(pre: &str, template: Option<&str>, architecture: &str) -> Family {
        if let Some(t) = template {
            if t.contains("dsml_token") && t.contains("DSML") {
                return Family::DeepSeekV4;
            }
            if t.contains("<|tool_call>") || t.contains("<|channel>") {
                return Family::Gemma4;
            }
            if t.contains("<|tool_call_start|>")
                || t.contains("<|tool_list_start|>")
                || t.contains("List of tools: [")
            {
                return Family::Lfm2;
            }
            if t.contains("<arg_key>") {
                return Family::Glm;
            }
            if t.contains("<start_of_turn>") {
                // Gemma 3's turn format: no tool format of its own (our family template writes JSON).
                return Family::JsonWrapper;
            }
            if t.contains("<tool_call>") || t.contains("<think>") {
                return Family::Qwen3;
            }
        }
        match pre {
            "qwen2" | "qwen35" | "deepseek-r1-qwen" => Family::Qwen3,
            "glm4" | "glm5" | "chatglm-bpe" => Family::Glm,
            "lfm2" => Family::Lfm2,
            "deepseek-v3" => Family::DeepSeekV4,
            "gemma4" => Family::Gemma4,
            _ => match architecture {
                a if a.starts_with("qwen3") => Family::Qwen3,
                a if a.starts_with("glm4") => Family::Glm,
                "gemma4" => Family::Gemma4,
                a if a.starts_with("deepseek") => Family::DeepSeekV4,
                a if a.starts_with("lfm2") => Family::Lfm2,
                _ => Family::JsonWrapper,
            },
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_round_trip_and_detection_prefers_the_template() {
        for f in Family::ALL {
            assert_eq!(Family::from_name(f.name()), Some(f));
        }
        assert_eq!(Family::detect("qwen2", None, "qwen3moe"), Family::Qwen3);
        assert_eq!(
            Family::detect("default", None, "gemma3"),
            Family::JsonWrapper
        );
        let glm = "{{ '<tool_call>' + name }}<arg_key>{{ k }}</arg_key>";
        assert_eq!(Family::detect("qwen2", Some(glm), "x"), Family::Glm);
        let gemma4 = "{{- '<|tool_call>call:' + name -}}";
        assert_eq!(
            Family::detect("default", Some(gemma4), "gemma4"),
            Family::Gemma4
        );
    }
}
