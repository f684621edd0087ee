// Chat templates: turning a list of messages into the prompt a model was fine-tuned on. We do not
// interpret Jinja; a checkpoint's `chat_template` (tokenizer_config.json) is recognized by the
// markers its family uses, and rendered by hand-written code for that family.
#pragma once

#include <filesystem>
#include <string>
#include <vector>

namespace bitdelta {

struct ChatMessage {
  std::string role;  // system | user | assistant
  std::string content;
};

enum class ChatFamily {
  kPlain,        // no template: "System: ...\n\nUser: ...\n\nAssistant:"
  kRoleMarkers,  // <|role|>\ncontent\n ... <|assistant|>\n (the demo family, Zephyr-like)
  kChatML,       // <|im_start|>role\ncontent<|im_end|>\n ... <|im_start|>assistant\n
  kLlama3,       // <|start_header_id|>role<|end_header_id|>\n\ncontent<|eot_id|> ...
  kLlama2,       // [INST] <<SYS>>\nsystem\n<</SYS>>\n\nuser [/INST] assistant </s><s>[INST] ...
  kMistral       // [INST] user [/INST]assistant</s>[INST] ...
};

const char* to_string(ChatFamily family);

// A piece of rendered text; `bos_before` / `eos_after` ask for the tokenizer's BOS / EOS ids around
// it (Llama-2 style templates put <s> and </s> between turns, which must be the control ids, not
// the text "<s>" that would encode as ordinary characters).
struct ChatSegment {
  std::string text;
  bool bos_before = false;
  bool eos_after = false;
};

class ChatTemplate {
 public:
  ChatTemplate() = default;  // kPlain
  explicit ChatTemplate(ChatFamily family) : family_(family) {}

  // Recognizes a Jinja template by its markers; `known` is false (and the family kPlain) when none
  // matches. An empty template is kPlain and known. Literals the family's renderer needs are read
  // from the template too: ChatML's default system message (Qwen2: "You are a helpful
  // assistant."), written when a conversation has none; Llama 3.1+'s system header ("Cutting
  // Knowledge Date: ..." and "Today Date: ...", today's date when the template calls strftime_now,
  // else its default date_string), written before every conversation.
  static ChatTemplate detect(const std::string& jinja, bool* known = nullptr);
  // Reads `chat_template` from dir/tokenizer_config.json (a string, or a list of {name, template}
  // where "default" is used). A missing file or field gives kPlain. Throws Error on malformed JSON.
  static ChatTemplate from_checkpoint(const std::filesystem::path& dir, bool* known = nullptr);

  ChatFamily family() const { return family_; }
  // What detect() read beyond the family, for logs ("" when nothing).
  std::string details() const;

  // The prompt for `messages` followed by the start of an assistant turn. The first segment is
  // always preceded by BOS (the tokenizer adds it, as Hugging Face's add_bos_token does), so the
  // template itself never writes BOS. Throws Error naming messages[i].role for an unknown role.
  std::vector<ChatSegment> render(const std::vector<ChatMessage>& messages) const;

 private:
  ChatFamily family_ = ChatFamily::kPlain;
  std::string default_system_;  // ChatML: the system message of a conversation without one
  std::string knowledge_date_;  // Llama 3.1+: "December 2023" ("": no system header)
  std::string today_;           // Llama 3.1+: the date; "" = today's, as strftime_now gives it
};

}  // namespace bitdelta
