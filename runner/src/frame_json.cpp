// The payload rule of PROTOCOL.md §5 ("Payload and tensor rule"): one strict
// JSON validator, the same rule as zl_device/formats/frames.py implements, plus
// the escaping of untrusted bytes for reasons and logs.
#include <cerrno>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <set>
#include <string>

#include "zl/frame.h"

namespace zl {
namespace {

// Decodes one strict UTF-8 sequence at p (end exclusive): no overlong forms,
// no surrogates (U+D800..U+DFFF), nothing above U+10FFFF. Returns the number
// of bytes (1..4) and the code point, or 0 for an invalid sequence.
size_t decode_utf8(const unsigned char* p, const unsigned char* end, uint32_t* cp) {
  const unsigned char c = p[0];
  if (c < 0x80) {
    *cp = c;
    return 1;
  }
  size_t n = 0;
  uint32_t v = 0, min = 0;
  if (c >= 0xC2 && c <= 0xDF) {
    n = 2, v = c & 0x1F, min = 0x80;
  } else if (c >= 0xE0 && c <= 0xEF) {
    n = 3, v = c & 0x0F, min = 0x800;
  } else if (c >= 0xF0 && c <= 0xF4) {
    n = 4, v = c & 0x07, min = 0x10000;
  } else {
    return 0;
  }
  if (static_cast<size_t>(end - p) < n) return 0;
  for (size_t i = 1; i < n; ++i) {
    if ((p[i] & 0xC0) != 0x80) return 0;
    v = (v << 6) | (p[i] & 0x3F);
  }
  if (v < min || v > 0x10FFFF || (v >= 0xD800 && v <= 0xDFFF)) return 0;
  *cp = v;
  return n;
}

void append_utf8(uint32_t cp, std::string* out) {
  if (cp < 0x80) {
    *out += static_cast<char>(cp);
  } else if (cp < 0x800) {
    *out += static_cast<char>(0xC0 | (cp >> 6));
    *out += static_cast<char>(0x80 | (cp & 0x3F));
  } else if (cp < 0x10000) {
    *out += static_cast<char>(0xE0 | (cp >> 12));
    *out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
    *out += static_cast<char>(0x80 | (cp & 0x3F));
  } else {
    *out += static_cast<char>(0xF0 | (cp >> 18));
    *out += static_cast<char>(0x80 | ((cp >> 12) & 0x3F));
    *out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
    *out += static_cast<char>(0x80 | (cp & 0x3F));
  }
}

// A recursive-descent validator of RFC 8259 JSON with the extra limits of the
// rule; recursion is bounded by kMaxFrameJsonDepth.
class Validator {
 public:
  Validator(const char* data, size_t size)
      : begin_(reinterpret_cast<const unsigned char*>(data)), p_(begin_), end_(begin_ + size) {}

  std::string run() {
    ws();
    if (p_ == end_ || *p_ != '{') return fail("the payload is not a JSON object");
    if (!value(1)) return error_;
    ws();
    if (p_ != end_) return fail("trailing bytes after the JSON object");
    return {};
  }

 private:
  std::string fail(const std::string& why) {
    if (error_.empty()) {
      error_ = why + " at byte " + std::to_string(p_ - begin_);
    }
    return error_;
  }
  bool bad(const std::string& why) {
    fail(why);
    return false;
  }

  void ws() {
    while (p_ != end_ && (*p_ == ' ' || *p_ == '\t' || *p_ == '\n' || *p_ == '\r')) ++p_;
  }

  bool literal(const char* word) {
    const size_t n = std::strlen(word);
    if (static_cast<size_t>(end_ - p_) < n || std::memcmp(p_, word, n) != 0) {
      return bad("invalid literal");
    }
    p_ += n;
    return true;
  }

  bool value(int depth) {
    if (p_ == end_) return bad("unexpected end of the payload");
    switch (*p_) {
      case '{': return object(depth);
      case '[': return array(depth);
      case '"': return string(nullptr);
      case 't': return literal("true");
      case 'f': return literal("false");
      case 'n': return literal("null");
      default:
        if (*p_ == '-' || (*p_ >= '0' && *p_ <= '9')) return number();
        return bad("unexpected byte 0x" + to_hex(p_, 1));
    }
  }

  bool object(int depth) {
    std::set<std::string> keys;
    return items(depth, '}', [&] {
      ws();
      if (p_ == end_ || *p_ != '"') return bad("expected an object key");
      std::string key;
      if (!string(&key)) return false;
      if (!keys.insert(key).second) {
        return bad("duplicate object key '" + escape_bytes(key) + "'");
      }
      ws();
      if (p_ == end_ || *p_ != ':') return bad("expected ':'");
      ++p_;
      ws();
      return value(depth + 1);
    });
  }

  bool array(int depth) {
    return items(depth, ']', [&] {
      ws();
      return value(depth + 1);
    });
  }

  // An object's or array's items after its opening byte (at p_): none, or `item` then ',' or `close`, repeated.
  template <typename Item>
  bool items(int depth, char close, Item item) {
    if (depth > kMaxFrameJsonDepth) {
      return bad("nesting deeper than " + std::to_string(kMaxFrameJsonDepth));
    }
    ++p_;  // '{' or '['
    ws();
    if (p_ != end_ && *p_ == close) {
      ++p_;
      return true;
    }
    for (;;) {
      if (!item()) return false;
      ws();
      if (p_ != end_ && *p_ == ',') {
        ++p_;
        continue;
      }
      if (p_ != end_ && *p_ == close) {
        ++p_;
        return true;
      }
      return bad(std::string("expected ',' or '") + close + "'");
    }
  }

  bool hex4(uint32_t* out) {
    if (end_ - p_ < 4) return bad("truncated \\u escape");
    uint32_t v = 0;
    for (int i = 0; i < 4; ++i) {
      const unsigned char c = p_[i];
      int d = -1;
      if (c >= '0' && c <= '9') d = c - '0';
      if (c >= 'a' && c <= 'f') d = c - 'a' + 10;
      if (c >= 'A' && c <= 'F') d = c - 'A' + 10;
      if (d < 0) return bad("invalid \\u escape");
      v = v * 16 + static_cast<uint32_t>(d);
    }
    p_ += 4;
    *out = v;
    return true;
  }

  // A string at p_ ('"'); its decoded UTF-8 goes to *out when out is set.
  bool string(std::string* out) {
    ++p_;
    for (;;) {
      if (p_ == end_) return bad("unterminated string");
      const unsigned char c = *p_;
      if (c == '"') {
        ++p_;
        return true;
      }
      if (c < 0x20) return bad("unescaped control character 0x" + to_hex(p_, 1) + " in a string");
      if (c == '\\') {
        ++p_;
        if (p_ == end_) return bad("unterminated string");
        const unsigned char e = *p_++;
        char plain = 0;
        switch (e) {
          case '"': plain = '"'; break;
          case '\\': plain = '\\'; break;
          case '/': plain = '/'; break;
          case 'b': plain = '\b'; break;
          case 'f': plain = '\f'; break;
          case 'n': plain = '\n'; break;
          case 'r': plain = '\r'; break;
          case 't': plain = '\t'; break;
          case 'u': {
            uint32_t cp = 0;
            if (!hex4(&cp)) return false;
            if (cp >= 0xDC00 && cp <= 0xDFFF) return bad("lone surrogate \\u escape");
            if (cp >= 0xD800 && cp <= 0xDBFF) {
              uint32_t low = 0;
              if (end_ - p_ < 2 || p_[0] != '\\' || p_[1] != 'u') {
                return bad("lone surrogate \\u escape");
              }
              p_ += 2;
              if (!hex4(&low)) return false;
              if (low < 0xDC00 || low > 0xDFFF) return bad("lone surrogate \\u escape");
              cp = 0x10000 + ((cp - 0xD800) << 10) + (low - 0xDC00);
            }
            if (out) append_utf8(cp, out);
            continue;
          }
          default:
            --p_;
            return bad("invalid escape");
        }
        if (out) *out += plain;
        continue;
      }
      uint32_t cp = 0;
      const size_t n = decode_utf8(p_, end_, &cp);
      if (n == 0) return bad("invalid UTF-8");
      if (out) out->append(reinterpret_cast<const char*>(p_), n);
      p_ += n;
    }
  }

  bool digits() {
    const unsigned char* start = p_;
    while (p_ != end_ && *p_ >= '0' && *p_ <= '9') ++p_;
    return p_ != start;
  }

  bool number() {
    const unsigned char* start = p_;
    const bool negative = *p_ == '-';
    if (negative) ++p_;
    if (p_ == end_ || *p_ < '0' || *p_ > '9') return bad("invalid number");
    const unsigned char* int_start = p_;
    if (*p_ == '0') {
      ++p_;
    } else {
      digits();
    }
    const std::string int_digits(int_start, p_);
    bool is_float = false;
    if (p_ != end_ && *p_ == '.') {
      ++p_;
      if (!digits()) return bad("invalid number");
      is_float = true;
    }
    if (p_ != end_ && (*p_ == 'e' || *p_ == 'E')) {
      ++p_;
      if (p_ != end_ && (*p_ == '+' || *p_ == '-')) ++p_;
      if (!digits()) return bad("invalid number");
      is_float = true;
    }
    if (!is_float) {
      // Integers: -2^63 .. 2^64-1 (what int64 or uint64 holds exactly).
      const std::string limit = negative ? "9223372036854775808" : "18446744073709551615";
      if (int_digits.size() > limit.size() ||
          (int_digits.size() == limit.size() && int_digits > limit)) {
        p_ = start;
        return bad("integer out of range");
      }
      return true;
    }
    // Other numbers: finite as an IEEE double. The "C" locale's strtod (zl
    // never calls setlocale) reads '.' as the decimal point.
    const std::string text(start, p_);
    char* parsed_end = nullptr;
    const double v = std::strtod(text.c_str(), &parsed_end);
    if (!std::isfinite(v)) {
      p_ = start;
      return bad("number out of range");
    }
    return true;
  }

  const unsigned char* begin_;
  const unsigned char* p_;
  const unsigned char* end_;
  std::string error_;
};

}  // namespace

std::string check_frame_json(const char* data, size_t size) {
  if (size == 0) return {};
  if (size > kMaxFrameJsonBytes) {
    return "JSON payload of " + std::to_string(size) + " bytes exceeds the maximum of " +
           std::to_string(kMaxFrameJsonBytes);
  }
  std::string why = Validator(data, size).run();
  if (!why.empty()) why = "JSON payload of " + std::to_string(size) + " bytes: " + why;
  return why;
}

std::string check_tensor_name(const std::string& name) {
  if (name.empty()) return "empty tensor name";
  const auto* p = reinterpret_cast<const unsigned char*>(name.data());
  const auto* end = p + name.size();
  while (p != end) {
    uint32_t cp = 0;
    const size_t n = decode_utf8(p, end, &cp);
    if (n == 0) return "tensor name '" + escape_bytes(name) + "' is not valid UTF-8";
    if (cp < 0x20 || cp == 0x7F) {
      return "tensor name '" + escape_bytes(name) + "' has a control character";
    }
    p += n;
  }
  return {};
}

std::string escape_bytes(const std::string& raw, size_t max_bytes) {
  static const char* const kDigits = "0123456789abcdef";
  std::string s;
  const size_t n = raw.size() < max_bytes ? raw.size() : max_bytes;
  for (size_t i = 0; i < n; ++i) {
    const auto c = static_cast<unsigned char>(raw[i]);
    if (c >= 0x20 && c < 0x7F && c != '\\' && c != '\'' && c != '"') {
      s += static_cast<char>(c);
    } else {
      s += "\\x";
      s += kDigits[c >> 4];
      s += kDigits[c & 15];
    }
  }
  if (raw.size() > n) s += "...";
  return s;
}

}  // namespace zl
