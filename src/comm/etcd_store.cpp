#include "comm/etcd_store.h"

#include <curl/curl.h>

#include <cstring>
#include <mutex>
#include <nlohmann/json.hpp>
#include <thread>

#include "core/error.h"
#include "core/log.h"

namespace moetrain {
namespace {

using Clock = std::chrono::steady_clock;
using nlohmann::json;

constexpr char kAlphabet[] = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";

size_t collect(char* p, size_t size, size_t n, void* out) {
  static_cast<std::string*>(out)->append(p, size * n);
  return size * n;
}

class EtcdStore : public RendezvousStore {
 public:
  EtcdStore(std::string base, std::chrono::milliseconds timeout) : base_(std::move(base)), timeout_(timeout) {
    static std::once_flag init;
    std::call_once(init, [] { curl_global_init(CURL_GLOBAL_DEFAULT); });
    curl_ = curl_easy_init();
    MT_CHECK(curl_ != nullptr, "etcd {}: curl_easy_init failed", base_);
  }
  ~EtcdStore() override { curl_easy_cleanup(curl_); }

  bool set_once(const std::string& key, const std::string& value) override {
    const json txn{{"compare", json::array({{{"key", base64_encode(key)}, {"target", "CREATE"}, {"result", "EQUAL"},
                                             {"create_revision", "0"}}})},
                   {"success", json::array({{{"request_put", {{"key", base64_encode(key)}, {"value", base64_encode(value)}}}}})}};
    return post("/v3/kv/txn", txn).value("succeeded", false);
  }

  std::optional<std::string> get(const std::string& key) override {
    auto kv = range(key);
    if (!kv) return std::nullopt;
    return base64_decode(kv->value("value", ""));
  }

  int64_t add(const std::string& key, int64_t delta) override {
    while (true) {
      auto kv = range(key);
      const int64_t old = kv ? std::stoll(base64_decode(kv->value("value", ""))) : 0;
      const std::string sum = std::to_string(old + delta);
      // The swap happens only when no one changed the key since it was read.
      json cmp = kv ? json{{"key", base64_encode(key)}, {"target", "MOD"}, {"result", "EQUAL"},
                           {"mod_revision", kv->value("mod_revision", "0")}}
                    : json{{"key", base64_encode(key)}, {"target", "CREATE"}, {"result", "EQUAL"},
                           {"create_revision", "0"}};
      const json txn{{"compare", json::array({cmp})},
                     {"success", json::array({{{"request_put", {{"key", base64_encode(key)}, {"value", base64_encode(sum)}}}}})}};
      if (post("/v3/kv/txn", txn).value("succeeded", false)) return old + delta;
    }
  }

  std::string description() const override { return "etcd " + base_; }

 private:
  std::optional<json> range(const std::string& key) {
    const json r = post("/v3/kv/range", json{{"key", base64_encode(key)}});
    if (!r.contains("kvs") || r["kvs"].empty()) return std::nullopt;
    return r["kvs"][0];
  }

  // POSTs `body` to etcd; retries connection failures and 5xx (etcd restarting, a leader
  // election) until the timeout; any other failure is an error naming the path and reply.
  json post(const std::string& path, const json& body) {
    const std::string url = base_ + path, text = body.dump();
    const auto deadline = Clock::now() + timeout_;
    auto pause = std::chrono::milliseconds(50);
    std::lock_guard<std::mutex> lock(mu_);
    while (true) {
      std::string reply;
      curl_easy_reset(curl_);
      curl_easy_setopt(curl_, CURLOPT_URL, url.c_str());
      curl_easy_setopt(curl_, CURLOPT_POSTFIELDS, text.c_str());
      curl_easy_setopt(curl_, CURLOPT_POSTFIELDSIZE, static_cast<long>(text.size()));
      curl_easy_setopt(curl_, CURLOPT_WRITEFUNCTION, collect);
      curl_easy_setopt(curl_, CURLOPT_WRITEDATA, &reply);
      curl_easy_setopt(curl_, CURLOPT_CONNECTTIMEOUT_MS, 2000L);
      curl_easy_setopt(curl_, CURLOPT_TIMEOUT_MS, 10000L);
      curl_easy_setopt(curl_, CURLOPT_NOSIGNAL, 1L);
      curl_slist* headers = curl_slist_append(nullptr, "Content-Type: application/json");
      curl_easy_setopt(curl_, CURLOPT_HTTPHEADER, headers);
      const CURLcode rc = curl_easy_perform(curl_);
      curl_slist_free_all(headers);
      long status = 0;
      curl_easy_getinfo(curl_, CURLINFO_RESPONSE_CODE, &status);
      if (rc == CURLE_OK && status == 200) {
        try {
          return json::parse(reply);
        } catch (const std::exception& e) {
          MT_THROW("etcd {}: the reply to {} is not JSON ({}): {}", base_, path, e.what(), reply.substr(0, 200));
        }
      }
      const std::string why = rc != CURLE_OK ? curl_easy_strerror(rc) : fmt::format("HTTP {}: {}", status, reply.substr(0, 200));
      MT_CHECK(rc != CURLE_OK || status >= 500, "etcd {}: {} failed: {}", base_, path, why);
      MT_CHECK(Clock::now() < deadline, "etcd {}: {} failed for {} s: {} (is etcd running there?)", base_, path,
               timeout_.count() / 1000.0, why);
      if (!warned_) spdlog::warn("etcd {}: {} failed ({}); retrying until {} s have passed", base_, path, why, timeout_.count() / 1000.0);
      warned_ = true;
      std::this_thread::sleep_for(pause);
      pause = std::min(pause * 2, std::chrono::milliseconds(1000));
    }
  }

  std::string base_;
  std::chrono::milliseconds timeout_;
  std::mutex mu_;  // one request at a time on the handle
  CURL* curl_ = nullptr;
  bool warned_ = false;
};

}  // namespace

std::string base64_encode(const std::string& bytes) {
  std::string out;
  out.reserve((bytes.size() + 2) / 3 * 4);
  for (size_t i = 0; i < bytes.size(); i += 3) {
    uint32_t v = static_cast<uint8_t>(bytes[i]) << 16;
    if (i + 1 < bytes.size()) v |= static_cast<uint8_t>(bytes[i + 1]) << 8;
    if (i + 2 < bytes.size()) v |= static_cast<uint8_t>(bytes[i + 2]);
    out += kAlphabet[(v >> 18) & 63];
    out += kAlphabet[(v >> 12) & 63];
    out += i + 1 < bytes.size() ? kAlphabet[(v >> 6) & 63] : '=';
    out += i + 2 < bytes.size() ? kAlphabet[v & 63] : '=';
  }
  return out;
}

std::string base64_decode(const std::string& text) {
  std::string out;
  uint32_t acc = 0;
  int bits = 0;
  for (char c : text) {
    if (c == '=') break;
    const char* p = std::strchr(kAlphabet, c);
    MT_CHECK(c != '\0' && p != nullptr, "base64: '{}' is not in the alphabet (in '{}')", c, text.substr(0, 80));
    acc = (acc << 6) | static_cast<uint32_t>(p - kAlphabet);
    bits += 6;
    if (bits >= 8) {
      bits -= 8;
      out += static_cast<char>((acc >> bits) & 0xff);
    }
  }
  return out;
}

std::unique_ptr<RendezvousStore> open_etcd_store(const std::string& endpoint, std::chrono::milliseconds timeout) {
  std::string base = endpoint.find("://") == std::string::npos ? "http://" + endpoint : endpoint;
  while (!base.empty() && base.back() == '/') base.pop_back();
  return std::make_unique<EtcdStore>(base, timeout);
}

}  // namespace moetrain
