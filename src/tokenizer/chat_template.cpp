#include "bitdelta/chat_template.h"

#include <fstream>
#include <nlohmann/json.hpp>

#include "bitdelta/error.h"

namespace bitdelta {

namespace {

bool contains(const std::string& s, const char* what) {
  return s.find(what) != std::string::npos;
}

std::string trim(const std::string& s) {
  const char* ws = " \t\n\r\f\v";
  const size_t a = s.find_first_not_of(ws);
  if (a == std::string::npos) return "";
  return s.substr(a, s.find_last_not_of(ws) - a + 1);
}

void check_roles(const std::vector<ChatMessage>& messages) {
  if (messages.empty()) fail("messages must not be empty");
  for (size_t i = 0; i < messages.size(); ++i) {
    const auto& r = messages[i].role;
    if (r != "system" && r != "user" && r != "assistant")
      fail("messages[", i, "].role must be system, user or assistant (got '", r, "')");
  }
}

// Llama-2 and Mistral: a system message is folded into the first user turn; turns are
// [INST] user [/INST] answer</s>, each exchange opened by BOS.
std::vector<ChatSegment> render_inst(const std::vector<ChatMessage>& messages, bool llama2) {
  std::string system;
  size_t first = 0;
  if (messages[0].role == "system") {
    system = messages[0].content;
    first = 1;
  }
  std::vector<ChatSegment> out;
  bool system_pending = !system.empty();
  for (size_t i = first; i < messages.size(); ++i) {
    const auto& m = messages[i];
    if (m.role == "system")
      fail("messages[", i, "].role: a system message is only allowed first for this template");
    if (m.role == "user") {
      std::string content = m.content;
      if (system_pending) {
        content =
            llama2 ? "<<SYS>>\n" + system + "\n<</SYS>>\n\n" + content : system + "\n\n" + content;
        system_pending = false;
      }
      out.push_back({"[INST] " + (llama2 ? trim(content) : content) + " [/INST]", true, false});
    } else {
      if (out.empty()) out.push_back({"", true, false});
      std::string& text = out.back().text;
      if (llama2) {
        text += ' ';
        text += trim(m.content);
        text += ' ';
      } else {
        text += m.content;
      }
      out.back().eos_after = true;
    }
  }
  if (out.empty())
    out.push_back({"[INST] " + (llama2 ? trim(system) : system) + " [/INST]", true, false});
  return out;
}

}  // namespace

const char* to_string(ChatFamily family) {
  switch (family) {
    case ChatFamily::kPlain:
      return "plain";
    case ChatFamily::kRoleMarkers:
      return "role-markers";
    case ChatFamily::kChatML:
      return "chatml";
    case ChatFamily::kLlama3:
      return "llama3";
    case ChatFamily::kLlama2:
      return "llama2";
    case ChatFamily::kMistral:
      return "mistral";
  }
  return "?";
}

ChatTemplate ChatTemplate::detect(const std::string& jinja, bool* known) {
  if (known) *known = true;
  if (jinja.empty()) return ChatTemplate(ChatFamily::kPlain);
  if (contains(jinja, "<|im_start|>")) return ChatTemplate(ChatFamily::kChatML);
  if (contains(jinja, "<|start_header_id|>")) return ChatTemplate(ChatFamily::kLlama3);
  if (contains(jinja, "[INST]"))
    return ChatTemplate(contains(jinja, "<<SYS>>") ? ChatFamily::kLlama2 : ChatFamily::kMistral);
  // The demo family writes the role between <| and |> with nothing else around the content.
  if (contains(jinja, "<|{{ message['role'] }}|>") ||
      contains(jinja, "<|{{ message[\"role\"] }}|>") || contains(jinja, "<|{{message['role']}}|>"))
    return ChatTemplate(ChatFamily::kRoleMarkers);
  if (known) *known = false;
  return ChatTemplate(ChatFamily::kPlain);
}

ChatTemplate ChatTemplate::from_checkpoint(const std::filesystem::path& dir, bool* known) {
  if (known) *known = true;
  const auto path = dir / "tokenizer_config.json";
  std::ifstream in(path);
  if (!in) return ChatTemplate(ChatFamily::kPlain);
  nlohmann::json config;
  try {
    config = nlohmann::json::parse(in);
  } catch (const nlohmann::json::exception& e) {
    fail(path.string(), ": not valid JSON (", e.what(), ")");
  }
  if (!config.is_object() || !config.contains("chat_template") || config["chat_template"].is_null())
    return ChatTemplate(ChatFamily::kPlain);
  const auto& t = config["chat_template"];
  if (t.is_string()) return detect(t.get<std::string>(), known);
  if (t.is_array()) {
    // Newer checkpoints list named templates; the "default" one is what apply_chat_template uses.
    for (const auto& item : t)
      if (item.is_object() && item.value("name", "") == "default" && item.contains("template") &&
          item["template"].is_string())
        return detect(item["template"].get<std::string>(), known);
  }
  fail(path.string(), ": chat_template must be a string or a list of {name, template}");
}

std::vector<ChatSegment> ChatTemplate::render(const std::vector<ChatMessage>& messages) const {
  check_roles(messages);
  std::string text;
  switch (family_) {
    case ChatFamily::kPlain: {
      for (const auto& m : messages) {
        std::string role = m.role;
        role[0] = char(role[0] - 'a' + 'A');
        text += role + ": " + m.content + "\n\n";
      }
      text += "Assistant:";
      break;
    }
    case ChatFamily::kRoleMarkers:
      for (const auto& m : messages) text += "<|" + m.role + "|>\n" + m.content + "\n";
      text += "<|assistant|>\n";
      break;
    case ChatFamily::kChatML:
      for (const auto& m : messages)
        text += "<|im_start|>" + m.role + "\n" + m.content + "<|im_end|>\n";
      text += "<|im_start|>assistant\n";
      break;
    case ChatFamily::kLlama3:
      for (const auto& m : messages)
        text += "<|start_header_id|>" + m.role + "<|end_header_id|>\n\n" + trim(m.content) +
                "<|eot_id|>";
      text += "<|start_header_id|>assistant<|end_header_id|>\n\n";
      break;
    case ChatFamily::kLlama2:
      return render_inst(messages, true);
    case ChatFamily::kMistral:
      return render_inst(messages, false);
  }
  return {ChatSegment{std::move(text), true, false}};
}

}  // namespace bitdelta
