#include "comm/store.h"

#include <gloo/rendezvous/file_store.h>
#include <gloo/rendezvous/hash_store.h>
// Debian puts hiredis.h under hiredis/; gloo's header asks for this switch to find it.
#define HIREDIS_NESTED_INCLUDE 1
#include <gloo/rendezvous/redis_store.h>

#include <fmt/ranges.h>

#include <charconv>
#include <filesystem>

#include "comm/launch_env.h"
#include "comm/tcp_store.h"
#include "core/error.h"

namespace moetrain {

struct Store::Backend {
  std::shared_ptr<gloo::rendezvous::Store> store;
  std::string description;
  bool file = false;
};

// What gloo's rendezvous sees: the same keys (prefixed) through Store, so gloo's waits
// use our timeout and its failures carry our messages.
class Store::GlooView : public gloo::rendezvous::Store {
 public:
  explicit GlooView(moetrain::Store* owner) : owner_(owner) {}
  void set(const std::string& key, const std::vector<char>& data) override { owner_->set(key, data); }
  std::vector<char> get(const std::string& key) override { return owner_->get(key); }
  void wait(const std::vector<std::string>& keys) override { owner_->wait(keys); }
  void wait(const std::vector<std::string>& keys, const std::chrono::milliseconds& timeout) override {
    owner_->wait(keys, timeout);
  }

 private:
  moetrain::Store* owner_;
};

std::pair<std::string, int> split_host_port(const std::string& what, const std::string& text, int default_port) {
  size_t colon = text.rfind(':');
  std::string host = colon == std::string::npos ? text : text.substr(0, colon);
  int port = default_port;
  if (colon != std::string::npos) {
    std::string p = text.substr(colon + 1);
    auto [end, ec] = std::from_chars(p.data(), p.data() + p.size(), port);
    MT_CHECK(ec == std::errc() && end == p.data() + p.size() && port > 0 && port < 65536,
             "{}: port '{}' is not a number from 1 to 65535", what, p);
  }
  if (host.size() > 1 && host.front() == '[' && host.back() == ']') host = host.substr(1, host.size() - 2);
  MT_CHECK(!host.empty() && port > 0, "{}: expected HOST:PORT", what);
  return {host, port};
}

Store::Store(std::shared_ptr<Backend> backend, std::string prefix, std::chrono::milliseconds timeout)
    : backend_(std::move(backend)), prefix_(std::move(prefix)), timeout_(timeout),
      view_(std::make_unique<GlooView>(this)) {}

Store::~Store() = default;

std::shared_ptr<Store> Store::open(const std::string& spec, int rank, std::chrono::milliseconds timeout) {
  auto b = std::make_shared<Backend>();
  try {
    if (spec == "memory") {
      b->store = std::make_shared<gloo::rendezvous::HashStore>();
      b->description = "memory store";
    } else if (spec.rfind("redis://", 0) == 0) {
      auto [host, port] = split_host_port(fmt::format("store '{}'", spec), spec.substr(8), 6379);
      b->store = std::make_shared<gloo::rendezvous::RedisStore>(host, port);
      b->description = "redis store " + spec.substr(8);
    } else if (spec.rfind("tcp://", 0) == 0) {
      auto [host, port] = split_host_port(fmt::format("store '{}'", spec), spec.substr(6), 0);
      b->store = std::make_shared<TcpStore>(host, port, rank == 0, timeout);
      b->description = "tcp store " + spec.substr(6);
    } else {
      MT_CHECK(spec.find("://") == std::string::npos,
               "store '{}': unknown kind (expected a directory, file:DIR, redis://HOST:PORT, tcp://HOST:PORT or "
               "memory)",
               spec);
      std::string dir = spec.rfind("file:", 0) == 0 ? spec.substr(5) : spec;
      MT_CHECK(!dir.empty(), "store '{}': empty directory", spec);
      std::error_code ec;
      std::filesystem::create_directories(dir, ec);
      MT_CHECK(std::filesystem::is_directory(dir), "store '{}': cannot create directory {}: {}", spec, dir,
               ec.message());
      b->store = std::make_shared<gloo::rendezvous::FileStore>(dir);
      b->description = "file store " + dir;
      b->file = true;
    }
  } catch (const Error&) {
    throw;
  } catch (const std::exception& e) {
    MT_THROW("store '{}': cannot open: {}", spec, e.what());
  }
  return std::shared_ptr<Store>(new Store(std::move(b), "", timeout));
}

std::shared_ptr<Store> Store::prefixed(const std::string& prefix) const {
  return std::shared_ptr<Store>(new Store(backend_, prefix_.empty() ? prefix : prefix_ + "/" + prefix, timeout_));
}

std::string Store::full_key(const std::string& key) const { return prefix_.empty() ? key : prefix_ + "/" + key; }

std::string Store::description() const {
  return prefix_.empty() ? backend_->description : backend_->description + " (prefix " + prefix_ + ")";
}

void Store::set(const std::string& key, const std::vector<char>& value) {
  try {
    backend_->store->set(full_key(key), value);
  } catch (const Error&) {
    throw;
  } catch (const std::exception& e) {
    // gloo's FileStore refuses a key whose file exists: an earlier run's directory.
    if (backend_->file && std::string(e.what()).find("already exists") != std::string::npos) {
      MT_THROW("{}: key '{}' is already set: the directory holds keys of an earlier run; give each run a fresh "
               "directory",
               description(), key);
    }
    MT_THROW("{}: cannot set key '{}': {}", description(), key, e.what());
  }
}

void Store::wait(const std::vector<std::string>& keys, std::chrono::milliseconds timeout) {
  std::vector<std::string> full;
  for (const std::string& k : keys) full.push_back(full_key(k));
  try {
    backend_->store->wait(full, timeout);
  } catch (const Error&) {
    throw;
  } catch (const std::exception& e) {
    MT_THROW("{}: keys {} not all set within {} s ({}): a rank did not join", description(),
             fmt::join(keys, ", "), timeout.count() / 1000.0, e.what());
  }
}

std::vector<char> Store::get(const std::string& key) {
  wait({key});
  try {
    return backend_->store->get(full_key(key));
  } catch (const Error&) {
    throw;
  } catch (const std::exception& e) {
    MT_THROW("{}: cannot read key '{}': {}", description(), key, e.what());
  }
}

gloo::rendezvous::Store& Store::gloo_view() { return *view_; }

std::string default_store_spec(const LaunchEnv& env) {
  if (!env.store.empty()) return env.store;
  if (env.world_size == 1) return "memory";
  if (!env.master_addr.empty() && env.master_port != 0) {
    int port = env.launcher == "torchrun" ? env.master_port + 1 : env.master_port;
    MT_CHECK(port < 65536, "environment: MASTER_PORT={} leaves no port for the store", env.master_port);
    bool v6 = env.master_addr.find(':') != std::string::npos;
    return fmt::format("tcp://{}{}{}:{}", v6 ? "[" : "", env.master_addr, v6 ? "]" : "", port);
  }
  MT_CHECK(env.single_node(),
           "{} spans several machines but names no store: set MOETRAIN_STORE (redis://HOST:PORT, tcp://HOST:PORT "
           "or a directory every machine shares) or MASTER_ADDR and MASTER_PORT",
           env.str());
  return (std::filesystem::temp_directory_path() / ("moetrain-store-" + env.run_id)).string();
}

}  // namespace moetrain
