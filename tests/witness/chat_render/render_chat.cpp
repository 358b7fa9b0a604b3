// render_chat: llama.cpp's own rendering of chat templates (its Jinja engine in common/, with the same
// message normalization and per-template workarounds as llama-server), for the server's template tests.
//
// usage: render_chat CASES.json > RENDERED.json
// CASES.json: {"templates": {"name": {"file": "path.jinja", "bos": "<bos>", "eos": "<eos>"}},
//              "conversations": {"name": {"messages": [...], "tools": [...], "add_generation_prompt": true}},
//              "cases": [{"template": "name", "conversation": "name"}]}
// Output: {"now": "...", "renders": [{"template", "conversation", "prompt"}]}; a failing render has
// "error" in place of "prompt". The time is fixed (2026-01-02 03:04:05 UTC) so strftime_now is stable.
// Built by build_render_chat.sh against /work/llama-build's libllama-common.so.

#include "chat.h"

#include <chrono>
#include <cstdio>
#include <fstream>
#include <iostream>
#include <sstream>

static std::string read_file(const std::string & path) {
    std::ifstream f(path, std::ios::binary);
    if (!f) {
        throw std::runtime_error("cannot read " + path);
    }
    std::stringstream ss;
    ss << f.rdbuf();
    return ss.str();
}

int main(int argc, char ** argv) {
    if (argc != 2) {
        std::fprintf(stderr, "usage: %s CASES.json\n", argv[0]);
        return 2;
    }
    const std::string cases_path = argv[1];
    const std::string base = cases_path.substr(0, cases_path.find_last_of('/') + 1);
    common_json spec = common_json::parse(read_file(cases_path));
    // 2026-01-02 03:04:05 UTC
    const auto now = std::chrono::system_clock::time_point(std::chrono::seconds(1767323045));

    common_json out = common_json::object();
    out["now"] = "2026-01-02T03:04:05Z";
    common_json renders = common_json::array();
    const common_json & cases = spec.at("cases");
    for (size_t i = 0; i < cases.size(); i++) {
        const std::string tname = cases.at(i).at("template").get<std::string>();
        const std::string cname = cases.at(i).at("conversation").get<std::string>();
        const common_json & t = spec.at("templates").at(tname);
        const common_json & c = spec.at("conversations").at(cname);
        common_json r = common_json::object();
        r["template"] = tname;
        r["conversation"] = cname;
        try {
            std::string src = read_file(base + t.at("file").get<std::string>());
            auto tmpls = common_chat_templates_init(nullptr, src, t.at("bos").get<std::string>(),
                                                    t.at("eos").get<std::string>());
            common_chat_templates_inputs inputs;
            inputs.messages = common_chat_msgs_parse_oaicompat(c.at("messages"));
            if (c.contains("tools")) {
                inputs.tools = common_chat_tools_parse_oaicompat(c.at("tools"));
            }
            inputs.add_generation_prompt = c.contains("add_generation_prompt") ?
                c.at("add_generation_prompt").get<bool>() : true;
            if (c.contains("enable_thinking")) {
                inputs.enable_thinking = c.at("enable_thinking").get<bool>();
            }
            inputs.use_jinja = true;
            inputs.now = now;
            r["prompt"] = common_chat_templates_apply(tmpls.get(), inputs).prompt;
        } catch (const std::exception & e) {
            r["error"] = std::string(e.what());
        }
        renders.push_back(r);
    }
    out["renders"] = renders;
    std::cout << out.dump(1) << "\n";
    return 0;
}
