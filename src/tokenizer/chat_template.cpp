#include "bitdelta/chat_template.h"

#include <ctime>
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

// A Jinja string literal's text with its escapes (\n, \t, \', \") resolved.
std::string unescape_jinja(const std::string& literal) {
  std::string out;
  for (size_t i = 0; i < literal.size(); ++i) {
    if (literal[i] != '\\' || i + 1 == literal.size()) {
      out += literal[i];
      continue;
    }
    const char c = literal[++i];
    out += c == 'n' ? '\n' : c == 't' ? '\t' : c;
  }
  return out;
}

// The text between `open` and `close` inside one Jinja string literal of `jinja` ("" if there is
// no such literal): where a template writes a fixed message, e.g. '<|im_start|>system\nYou are a
// helpful assistant.<|im_end|>\n'. Text joined from variables ('...' + x + '...') does not count.
// A "\n" in `open` or `close` matches the escape (how templates write it) or a raw newline.
std::string literal_between(const std::string& jinja, std::string open, std::string close) {
  for (int raw = 0; raw < 2; ++raw) {
    for (size_t at = jinja.find(open); at != std::string::npos; at = jinja.find(open, at + 1)) {
      const size_t from = at + open.size();
      const size_t to = jinja.find(close, from);
      if (to == std::string::npos) break;
      const std::string inside = jinja.substr(from, to - from);
      if (inside.find_first_of("'\"{}") == std::string::npos) return unescape_jinja(inside);
    }
    for (std::string* s : {&open, &close}) {
      std::string raw_newlines;
      for (size_t i = 0; i < s->size(); ++i) {
        const bool escape = s->compare(i, 2, "\\n") == 0;
        raw_newlines += escape ? '\n' : (*s)[i];
        i += escape;
      }
      *s = std::move(raw_newlines);
    }
  }
  return "";
}

// Today's date as Llama 3.2's template writes it: strftime_now("%d %b %Y"), e.g. "05 Dec 2026".
std::string today() {
  const std::time_t now = std::time(nullptr);
  std::tm local{};
  localtime_r(&now, &local);
  char buf[32];
  std::strftime(buf, sizeof buf, "%d %b %Y", &local);
  return buf;
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

std::string ChatTemplate::details() const {
  if (!default_system_.empty()) return "default system message \"" + default_system_ + "\"";
  if (!knowledge_date_.empty())
    return "system header: knowledge " + knowledge_date_ + ", today " +
           (today_.empty() ? "the current date" : today_);
  return "";
}

ChatTemplate ChatTemplate::detect(const std::string& jinja, bool* known) {
  if (known) *known = true;
  if (jinja.empty()) return ChatTemplate(ChatFamily::kPlain);
  if (contains(jinja, "<|im_start|>")) {
    ChatTemplate t(ChatFamily::kChatML);
    t.default_system_ = literal_between(jinja, "<|im_start|>system\\n", "<|im_end|>");
    return t;
  }
  if (contains(jinja, "<|start_header_id|>")) {
    ChatTemplate t(ChatFamily::kLlama3);
    t.knowledge_date_ = literal_between(jinja, "Cutting Knowledge Date: ", "\\n");
    if (!t.knowledge_date_.empty() && !contains(jinja, "strftime_now")) {
      const size_t at = jinja.find("set date_string = ");
      if (at != std::string::npos && at + 19 < jinja.size()) {
        const char quote = jinja[at + 18];
        const size_t end = jinja.find(quote, at + 19);
        if (end != std::string::npos) t.today_ = jinja.substr(at + 19, end - at - 19);
      }
    }
    return t;
  }
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
      if (!default_system_.empty() && messages[0].role != "system")
        text += "<|im_start|>system\n" + default_system_ + "<|im_end|>\n";
      for (const auto& m : messages)
        text += "<|im_start|>" + m.role + "\n" + m.content + "<|im_end|>\n";
      text += "<|im_start|>assistant\n";
      break;
    case ChatFamily::kLlama3: {
      size_t first = 0;
      if (!knowledge_date_.empty()) {
        // Llama 3.1+: one system block always comes first, holding the dates and then the
        // conversation's first system message (trimmed), if any.
        std::string system;
        if (messages[0].role == "system") {
          system = trim(messages[0].content);
          first = 1;
        }
        text += "<|start_header_id|>system<|end_header_id|>\n\nCutting Knowledge Date: " +
                knowledge_date_ + "\nToday Date: " + (today_.empty() ? today() : today_) + "\n\n" +
                system + "<|eot_id|>";
      }
      for (size_t i = first; i < messages.size(); ++i)
        text += "<|start_header_id|>" + messages[i].role + "<|end_header_id|>\n\n" +
                trim(messages[i].content) + "<|eot_id|>";
      text += "<|start_header_id|>assistant<|end_header_id|>\n\n";
      break;
    }
    case ChatFamily::kLlama2:
      return render_inst(messages, true);
    case ChatFamily::kMistral:
      return render_inst(messages, false);
  }
  return {ChatSegment{std::move(text), true, false}};
}

}  // namespace bitdelta
