// A small, safe Markdown renderer for the chat page: the text is HTML-escaped first, so nothing a model
// writes can become markup except what the rules below make (fenced and inline code, headings, lists,
// block quotes, rules, emphasis, and links to http(s)/mailto addresses). An unclosed fence (a reply still
// streaming) renders as code up to the end.
"use strict";

function escapeHtml(text) {
  return text.replace(/&/g, "&amp;").replace(/</g, "&lt;").replace(/>/g, "&gt;")
    .replace(/"/g, "&quot;").replace(/'/g, "&#39;");
}

// Inline rules over already-escaped text. Code spans are cut out first so that nothing inside them is
// read as emphasis or links.
function renderInline(escaped) {
  const spans = [];
  let text = escaped.replace(/`([^`]+)`/g, (_, code) => {
    spans.push("<code>" + code + "</code>");
    return "\u0000" + (spans.length - 1) + "\u0000";
  });
  text = text.replace(/\[([^\]]+)\]\(([^)\s]+)\)/g, (whole, label, url) => {
    // Escaping turned & into &amp; already; only these schemes (or a relative path) are followed.
    if (!/^(https?:\/\/|mailto:|\/|#)/i.test(url)) return whole;
    return '<a href="' + url + '" target="_blank" rel="noopener noreferrer">' + label + "</a>";
  });
  text = text.replace(/\*\*([^*]+)\*\*/g, "<strong>$1</strong>")
    .replace(/__([^_]+)__/g, "<strong>$1</strong>")
    .replace(/(^|[^*])\*([^*\s][^*]*)\*/g, "$1<em>$2</em>")
    .replace(/(^|[^\w_])_([^_\s][^_]*)_(?!\w)/g, "$1<em>$2</em>")
    .replace(/~~([^~]+)~~/g, "<del>$1</del>");
  return text.replace(/\u0000(\d+)\u0000/g, (_, i) => spans[Number(i)]);
}

function renderMarkdown(source) {
  const lines = escapeHtml(source.replace(/\r\n?/g, "\n")).split("\n");
  const out = [];
  let paragraph = [];
  let list = null; // {tag: "ul" | "ol", items: []}
  const flushParagraph = () => {
    if (paragraph.length) out.push("<p>" + paragraph.map(renderInline).join("<br>") + "</p>");
    paragraph = [];
  };
  const flushList = () => {
    if (list) out.push("<" + list.tag + ">" + list.items.map((i) => "<li>" + renderInline(i) + "</li>").join("") + "</" + list.tag + ">");
    list = null;
  };
  for (let i = 0; i < lines.length; i++) {
    const line = lines[i];
    const fence = line.match(/^\s*(```+|~~~+)\s*([\w+#.-]*)\s*$/);
    if (fence) {
      flushParagraph();
      flushList();
      const code = [];
      i++;
      while (i < lines.length && !lines[i].trim().startsWith(fence[1])) code.push(lines[i++]);
      const lang = fence[2] ? ' class="language-' + fence[2] + '"' : "";
      out.push("<pre><code" + lang + ">" + code.join("\n") + "</code></pre>");
      continue;
    }
    const heading = line.match(/^(#{1,6})\s+(.*)$/);
    const bullet = line.match(/^\s*[-*+]\s+(.*)$/);
    const numbered = line.match(/^\s*\d+[.)]\s+(.*)$/);
    if (heading) {
      flushParagraph();
      flushList();
      const n = heading[1].length;
      out.push("<h" + n + ">" + renderInline(heading[2]) + "</h" + n + ">");
    } else if (/^\s*([-*_])(\s*\1){2,}\s*$/.test(line)) {
      flushParagraph();
      flushList();
      out.push("<hr>");
    } else if (bullet || numbered) {
      flushParagraph();
      const tag = bullet ? "ul" : "ol";
      if (list && list.tag !== tag) flushList();
      if (!list) list = { tag, items: [] };
      list.items.push((bullet || numbered)[1]);
    } else if (/^&gt;\s?/.test(line)) {
      flushParagraph();
      flushList();
      out.push("<blockquote>" + renderInline(line.replace(/^&gt;\s?/, "")) + "</blockquote>");
    } else if (line.trim() === "") {
      flushParagraph();
      flushList();
    } else {
      flushList();
      paragraph.push(line);
    }
  }
  flushParagraph();
  flushList();
  return out.join("\n");
}
