// Compiles every C++ block of the documentation: the ```cpp fences of README.md and docs/*.md
// of a checkout, each wrapped in a translation unit and checked with the compiler's
// -fsyntax-only against the library's include directories and definitions. The rules a block
// follows (markers, includes, wrapping) are those of docs/10-testing.md, "The snippets in the
// docs"; this file is their only implementation.
//
//   doc_snippets --root <checkout> --out <dir> --flags <file> [--jobs N]
//
// --flags names a file with one compiler argument per line, the compiler first (the build writes
// it from the tandem target's usage requirements: tests/docs/CMakeLists.txt). Each snippet
// becomes <out>/<file>_<line>.cpp; its compiler output goes next to it as .log. Prints one line
// per snippet (compiled, fragment with its reason, FAILED with the compiler's output) and exits
// 1 when a snippet fails, a marker is malformed or out of place, or no block is found at all.
#include <algorithm>
#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <mutex>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

namespace fs = std::filesystem;

namespace {

enum class Kind { Statements, Declarations, Members, Fragment };

struct Snippet {
  std::string file;  // relative to the root, e.g. "docs/04-lenet.md"
  int fence_line;    // 1-based line of the opening fence
  int marker_line = 0;  // the marker's line, 0 without one
  Kind kind = Kind::Statements;
  std::string params;  // statements(...): the function's parameters; members(...): the class's data
  std::string reason;  // fragment (...): why it is not compiled
  std::vector<std::string> lines;
  bool failed = false;
  std::string output;  // the compiler's, when it failed
};

std::string trim(const std::string& s) {
  const size_t b = s.find_first_not_of(" \t\r");
  if (b == std::string::npos) return "";
  const size_t e = s.find_last_not_of(" \t\r");
  return s.substr(b, e - b + 1);
}

bool starts_with(const std::string& s, const std::string& p) { return s.rfind(p, 0) == 0; }

// A fence: spaces, then three or more ` or ~. Returns its length (0: not a fence) and sets
// `indent`, `ch` and `info` (the rest of the line, trimmed). Any indentation counts (CommonMark
// allows three spaces, more inside a list item): a block is never skipped for its indentation.
size_t fence_of(const std::string& line, size_t& indent, char& ch, std::string& info) {
  indent = 0;
  while (indent < line.size() && line[indent] == ' ') ++indent;
  if (indent >= line.size() || (line[indent] != '`' && line[indent] != '~')) return 0;
  ch = line[indent];
  size_t n = 0;
  while (indent + n < line.size() && line[indent + n] == ch) ++n;
  if (n < 3) return 0;
  info = trim(line.substr(indent + n));
  return n;
}

bool is_cpp_info(const std::string& info) {
  const std::string word = info.substr(0, info.find_first_of(" \t{"));
  return word == "cpp" || word == "c++" || word == "cxx" || word == "cc";
}

// Parses "<!-- snippet: ... -->" into `s`; returns an error message, empty when it is valid.
std::string parse_marker(const std::string& text, Snippet& s) {
  std::string body = trim(text.substr(std::string("<!-- snippet:").size()));
  if (body.size() < 3 || body.compare(body.size() - 3, 3, "-->") != 0)
    return "a snippet marker must end with -->";
  body = trim(body.substr(0, body.size() - 3));
  if (body == "declarations") {
    s.kind = Kind::Declarations;
    return "";
  }
  auto parenthesized = [&](const std::string& word, std::string& inside) {
    if (!starts_with(body, word)) return false;
    const std::string rest = trim(body.substr(word.size()));
    if (rest.size() < 2 || rest.front() != '(' || rest.back() != ')') return false;
    inside = trim(rest.substr(1, rest.size() - 2));
    return true;
  };
  if (body == "statements") {
    s.kind = Kind::Statements;
    return "";
  }
  if (parenthesized("statements", s.params)) {
    s.kind = Kind::Statements;
    return "";
  }
  if (parenthesized("members", s.params)) {
    s.kind = Kind::Members;
    return "";
  }
  if (parenthesized("fragment", s.reason)) {
    if (s.reason.empty()) return "a fragment marker names its reason: <!-- snippet: fragment (why) -->";
    s.kind = Kind::Fragment;
    return "";
  }
  return "unknown snippet marker '" + body +
         "' (expected statements, statements(<parameters>), declarations, members(<data members>) or "
         "fragment (<why>))";
}

// Every C++ block of one Markdown file. Errors (a malformed marker, a marker that is not on the
// line right before a C++ fence, an unclosed fence) are appended to `errors`.
void extract(const fs::path& root, const fs::path& path, std::vector<Snippet>& out,
             std::vector<std::string>& errors) {
  const std::string rel = fs::relative(path, root).generic_string();
  std::ifstream in(path);
  if (!in) {
    errors.push_back(rel + ": cannot read");
    return;
  }
  std::vector<std::string> lines;
  for (std::string l; std::getline(in, l);) lines.push_back(l);

  bool pending = false;  // a marker on the previous line
  Snippet next;
  int marker_line = 0;
  for (size_t i = 0; i < lines.size(); ++i) {
    const int lineno = static_cast<int>(i) + 1;
    size_t indent;
    char ch;
    std::string info;
    const size_t n = fence_of(lines[i], indent, ch, info);
    if (n == 0) {
      if (pending) {
        errors.push_back(rel + ":" + std::to_string(marker_line) +
                         ": a snippet marker must be on the line right before a ```cpp fence");
        pending = false;
      }
      const std::string t = trim(lines[i]);
      if (starts_with(t, "<!-- snippet:")) {
        next = Snippet{};
        const std::string err = parse_marker(t, next);
        if (!err.empty()) {
          errors.push_back(rel + ":" + std::to_string(lineno) + ": " + err);
        } else {
          pending = true;
          marker_line = lineno;
        }
      }
      continue;
    }
    // A fence opens here: find where it closes (same character, at least as long, no info).
    size_t close = i + 1;
    for (; close < lines.size(); ++close) {
      size_t ci;
      char cc;
      std::string cinfo;
      const size_t cn = fence_of(lines[close], ci, cc, cinfo);
      if (cn >= n && cc == ch && cinfo.empty()) break;
    }
    if (close == lines.size()) {
      errors.push_back(rel + ":" + std::to_string(lineno) + ": fence is never closed");
      return;
    }
    if (is_cpp_info(info)) {
      Snippet s = pending ? next : Snippet{};
      if (pending) s.marker_line = marker_line;
      s.file = rel;
      s.fence_line = lineno;
      for (size_t k = i + 1; k < close; ++k) {
        // Content lines lose up to the fence's own indentation (CommonMark).
        const std::string& l = lines[k];
        size_t strip = 0;
        while (strip < indent && strip < l.size() && l[strip] == ' ') ++strip;
        s.lines.push_back(l.substr(strip));
      }
      out.push_back(std::move(s));
    } else if (pending) {
      errors.push_back(rel + ":" + std::to_string(marker_line) +
                       ": a snippet marker stands before a fence that is not ```cpp");
    }
    pending = false;
    i = close;
  }
  if (pending)
    errors.push_back(rel + ":" + std::to_string(marker_line) +
                     ": a snippet marker must be on the line right before a ```cpp fence");
}

// The translation unit of one snippet: its #include lines first (or <tandem/tandem.h> when it
// names none), `using namespace tandem;`, then the snippet: at namespace scope, as the body of
// a function, or as the member functions of a class. #line directives make the compiler name the Markdown file and line.
std::string translation_unit(const Snippet& s) {
  std::ostringstream tu;
  tu << "// " << s.file << ":" << s.fence_line << ", generated by tests/docs/doc_snippets.cpp\n";
  std::vector<std::string> body = s.lines;
  bool any_include = false;
  for (size_t k = 0; k < body.size(); ++k) {
    const std::string t = trim(body[k]);
    if (starts_with(t, "#include")) {
      tu << "#line " << (s.fence_line + 1 + static_cast<int>(k)) << " \"" << s.file << "\"\n"
         << body[k] << "\n";
      body[k].clear();  // hoisted; the line stays (empty) so that numbers still match
      any_include = true;
    }
  }
  if (!any_include) tu << "#include <tandem/tandem.h>\n";
  // What the wrapper adds is one line, numbered as the marker's: an error in the marker's
  // parameters or members is reported there. (namespace tandem {} lets a block that includes
  // only standard headers compile too.)
  tu << "#line " << (s.marker_line > 0 ? s.marker_line : s.fence_line) << " \"" << s.file << "\"\n"
     << "namespace tandem {} using namespace tandem;";
  if (s.kind == Kind::Statements)
    tu << " [[maybe_unused]] static void tandem_doc_snippet(" << s.params << ") {";
  if (s.kind == Kind::Members) tu << " struct tandem_doc_snippet { " << s.params << ";";
  tu << "\n";
  tu << "#line " << (s.fence_line + 1) << " \"" << s.file << "\"\n";
  for (const std::string& l : body) tu << l << "\n";
  if (s.kind == Kind::Statements) tu << "}\n";
  if (s.kind == Kind::Members) tu << "};\n";
  return tu.str();
}

std::string shell_quote(const std::string& s) {
  std::string q = "'";
  for (char c : s) q += c == '\'' ? std::string("'\\''") : std::string(1, c);
  return q + "'";
}

std::string read_all(const fs::path& p) {
  std::ifstream in(p);
  std::ostringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

int usage(const char* msg) {
  std::cerr << "doc_snippets: " << msg
            << "\nusage: doc_snippets --root <checkout> --out <dir> --flags <file> [--jobs N]\n";
  return 2;
}

}  // namespace

int main(int argc, char** argv) {
  fs::path root, out, flags_file;
  int jobs = 2;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (i + 1 >= argc) return usage(("missing value after " + a).c_str());
    if (a == "--root") root = argv[++i];
    else if (a == "--out") out = argv[++i];
    else if (a == "--flags") flags_file = argv[++i];
    else if (a == "--jobs") jobs = std::max(1, std::atoi(argv[++i]));
    else return usage(("unknown argument " + a).c_str());
  }
  if (root.empty() || out.empty() || flags_file.empty()) return usage("--root, --out and --flags are required");

  std::vector<std::string> command;  // the compiler, then its arguments
  {
    std::ifstream in(flags_file);
    if (!in) return usage(("cannot read the flags file " + flags_file.string()).c_str());
    for (std::string l; std::getline(in, l);) {
      l = trim(l);
      // An empty generator-expression entry leaves a bare -I or -D behind.
      if (!l.empty() && l != "-I" && l != "-D") command.push_back(l);
    }
    if (command.empty()) return usage(("the flags file " + flags_file.string() + " is empty").c_str());
  }

  // The documentation: README.md and every docs/*.md, found at run time (a new chapter is
  // checked without reconfiguring).
  std::vector<fs::path> docs;
  if (fs::exists(root / "README.md")) docs.push_back(root / "README.md");
  if (fs::is_directory(root / "docs"))
    for (const auto& e : fs::directory_iterator(root / "docs"))
      if (e.is_regular_file() && e.path().extension() == ".md") docs.push_back(e.path());
  std::sort(docs.begin(), docs.end());

  std::vector<Snippet> snippets;
  std::vector<std::string> errors;
  for (const fs::path& p : docs) extract(root, p, snippets, errors);

  std::cout << "doc snippets: " << snippets.size() << " C++ blocks in " << docs.size()
            << " Markdown files under " << root.string() << " (README.md, docs/*.md)\n";
  for (const std::string& e : errors) std::cout << "  ERROR     " << e << "\n";
  if (snippets.empty()) {
    std::cout << "doc snippets: found no ```cpp block: is --root a checkout?\n";
    return 1;
  }

  fs::create_directories(out);
  std::vector<size_t> to_compile;
  for (size_t i = 0; i < snippets.size(); ++i) {
    if (snippets[i].kind == Kind::Fragment) continue;
    std::string stem = snippets[i].file;
    std::replace(stem.begin(), stem.end(), '/', '_');
    stem = stem.substr(0, stem.size() - 3) + "_" + std::to_string(snippets[i].fence_line);
    const fs::path tu = out / (stem + ".cpp");
    std::ofstream(tu) << translation_unit(snippets[i]);
    to_compile.push_back(i);
    snippets[i].output = tu.string();  // the path, until the compiler's output replaces it
  }

  // Two compilers at a time by default: -fsyntax-only of one snippet takes about a second.
  std::atomic<size_t> next{0};
  auto worker = [&] {
    for (size_t k; (k = next++) < to_compile.size();) {
      Snippet& s = snippets[to_compile[k]];
      const std::string tu = s.output;
      const std::string log = tu.substr(0, tu.size() - 4) + ".log";
      std::string cmd;
      for (const std::string& c : command) cmd += shell_quote(c) + " ";
      cmd += "-fsyntax-only " + shell_quote(tu) + " > " + shell_quote(log) + " 2>&1";
      s.failed = std::system(cmd.c_str()) != 0;
      s.output = s.failed ? read_all(log) : "";
    }
  };
  std::vector<std::thread> pool;
  for (int j = 0; j < jobs; ++j) pool.emplace_back(worker);
  for (auto& t : pool) t.join();

  size_t compiled = 0, fragments = 0, failed = 0;
  for (const Snippet& s : snippets) {
    const std::string where = s.file + ":" + std::to_string(s.fence_line);
    if (s.kind == Kind::Fragment) {
      ++fragments;
      std::cout << "  fragment  " << where << ": not compiled (" << s.reason << ")\n";
    } else if (s.failed) {
      ++failed;
      std::cout << "  FAILED    " << where << "\n" << s.output;
    } else {
      ++compiled;
      std::cout << "  compiled  " << where << "\n";
    }
  }
  std::cout << "doc snippets: " << compiled << " compiled, " << fragments << " fragments skipped, "
            << failed << " failed, " << errors.size() << " marker errors\n";
  return failed == 0 && errors.empty() && compiled > 0 ? 0 : 1;
}
