#include "engine/checkpoint/s3_client.h"

#include <curl/curl.h>
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>
#include <xxhash.h>

#include <algorithm>
#include <cctype>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <thread>

#include "core/log.h"
#include "engine/ft/fault.h"

namespace moetrain {
namespace {

std::string env(const char* name) {
  const char* v = std::getenv(name);
  return v ? std::string(v) : std::string();
}

// RFC 3986 percent-encoding as SigV4 wants it: unreserved characters stay, '/' stays in a
// path, everything else is %XX (upper case hex).
std::string uri_encode(std::string_view s, bool keep_slash) {
  static const char* hex = "0123456789ABCDEF";
  std::string out;
  for (unsigned char c : s) {
    if (std::isalnum(c) || c == '-' || c == '_' || c == '.' || c == '~' || (keep_slash && c == '/')) {
      out += static_cast<char>(c);
    } else {
      out += '%';
      out += hex[c >> 4];
      out += hex[c & 15];
    }
  }
  return out;
}

std::string xml_unescape(std::string s) {
  static const std::pair<const char*, const char*> entities[] = {
      {"&quot;", "\""}, {"&apos;", "'"}, {"&lt;", "<"}, {"&gt;", ">"}, {"&#34;", "\""}, {"&amp;", "&"}};
  for (const auto& [from, to] : entities) {
    for (size_t at = s.find(from); at != std::string::npos; at = s.find(from, at + std::strlen(to))) {
      s.replace(at, std::strlen(from), to);
    }
  }
  return s;
}

// The text of every <tag>...</tag> in `xml`, in order. S3's answers are flat enough that
// this is all the XML reading the calls here need.
std::vector<std::string> xml_all(std::string_view xml, const std::string& tag) {
  std::vector<std::string> out;
  const std::string open = "<" + tag + ">", close = "</" + tag + ">";
  for (size_t at = xml.find(open); at != std::string_view::npos; at = xml.find(open, at)) {
    const size_t begin = at + open.size(), end = xml.find(close, begin);
    if (end == std::string_view::npos) break;
    out.push_back(xml_unescape(std::string(xml.substr(begin, end - begin))));
    at = end + close.size();
  }
  return out;
}

std::string xml_first(std::string_view xml, const std::string& tag) {
  auto all = xml_all(xml, tag);
  return all.empty() ? std::string() : all.front();
}

std::string xml_escape(const std::string& s) {
  std::string out;
  for (char c : s) {
    switch (c) {
      case '&': out += "&amp;"; break;
      case '<': out += "&lt;"; break;
      case '>': out += "&gt;"; break;
      case '"': out += "&quot;"; break;
      default: out += c;
    }
  }
  return out;
}

void global_init() {
  static std::once_flag once;
  std::call_once(once, [] { curl_global_init(CURL_GLOBAL_DEFAULT); });
}

// A local file mapped read-only (what put_file sends, part by part).
struct MappedFile {
  explicit MappedFile(const std::string& path) {
    fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
    MT_CHECK(fd >= 0, "{}: cannot open for upload: {}", path, std::strerror(errno));
    struct stat st{};
    MT_CHECK(::fstat(fd, &st) == 0, "{}: cannot stat: {}", path, std::strerror(errno));
    size = static_cast<uint64_t>(st.st_size);
    if (size > 0) {
      void* m = ::mmap(nullptr, size, PROT_READ, MAP_PRIVATE, fd, 0);
      MT_CHECK(m != MAP_FAILED, "{}: cannot map: {}", path, std::strerror(errno));
      data = static_cast<const char*>(m);
    }
  }
  ~MappedFile() {
    if (data) ::munmap(const_cast<char*>(data), size);
    if (fd >= 0) ::close(fd);
  }
  int fd = -1;
  const char* data = nullptr;
  uint64_t size = 0;
};

}  // namespace

S3Options S3Options::from_env(const std::string& endpoint) {
  S3Options o;
  o.region = env("AWS_REGION");
  if (o.region.empty()) o.region = env("AWS_DEFAULT_REGION");
  if (o.region.empty()) o.region = "us-east-1";
  o.endpoint = endpoint;
  if (o.endpoint.empty()) o.endpoint = env("AWS_ENDPOINT_URL_S3");
  if (o.endpoint.empty()) o.endpoint = env("AWS_ENDPOINT_URL");
  if (o.endpoint.empty()) o.endpoint = "https://s3." + o.region + ".amazonaws.com";
  while (!o.endpoint.empty() && o.endpoint.back() == '/') o.endpoint.pop_back();
  MT_CHECK(o.endpoint.rfind("http://", 0) == 0 || o.endpoint.rfind("https://", 0) == 0,
           "S3 endpoint '{}' (AWS_ENDPOINT_URL or [checkpoint].remote_endpoint) must start with http:// or https://",
           o.endpoint);
  o.access_key = env("AWS_ACCESS_KEY_ID");
  o.secret_key = env("AWS_SECRET_ACCESS_KEY");
  o.session_token = env("AWS_SESSION_TOKEN");
  MT_CHECK(!o.access_key.empty() && !o.secret_key.empty(),
           "S3 credentials: set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (missing: {}) for the endpoint {}",
           o.access_key.empty() ? (o.secret_key.empty() ? "both" : "AWS_ACCESS_KEY_ID") : "AWS_SECRET_ACCESS_KEY",
           o.endpoint);
  return o;
}

S3Location S3Location::parse(const std::string& url) {
  MT_CHECK(url.rfind("s3://", 0) == 0 && url.size() > 5 && url[5] != '/',
           "'{}' is not an S3 location: expected s3://bucket or s3://bucket/prefix", url);
  S3Location loc;
  const std::string rest = url.substr(5);
  const size_t slash = rest.find('/');
  loc.bucket = rest.substr(0, slash);
  if (slash != std::string::npos) loc.prefix = rest.substr(slash + 1);
  while (!loc.prefix.empty() && loc.prefix.back() == '/') loc.prefix.pop_back();
  MT_CHECK(loc.prefix.empty() || loc.prefix.front() != '/', "'{}': the prefix must not start with '/'", url);
  return loc;
}

std::string S3Location::url(const std::string& key) const { return "s3://" + bucket + (key.empty() ? "" : "/" + key); }

// One S3 request: what to send and where the answer's body goes.
struct S3Client::Request {
  const char* method = "GET";
  std::string bucket, key;
  std::vector<std::pair<std::string, std::string>> query;
  std::vector<std::string> headers;
  std::string_view body;  // PUT / POST payload
  int out_fd = -1;        // GET: a 2xx body goes into this file instead of the response
  // State of the attempt in flight.
  size_t sent = 0;
  uint64_t received = 0;
  XXH3_state_t* hash = nullptr;
  long status = 0;
  std::string write_error;
};

std::string S3Client::Response::header(const std::string& name) const {
  for (const auto& [k, v] : headers) {
    if (k == name) return v;
  }
  return "";
}

S3Client::S3Client(S3Options options) : opt_(std::move(options)) {
  global_init();
  curl_ = curl_easy_init();
  MT_CHECK(curl_ != nullptr, "S3: curl_easy_init failed");
}

S3Client::~S3Client() { curl_easy_cleanup(static_cast<CURL*>(curl_)); }

namespace {

size_t read_body(char* buf, size_t size, size_t n, void* user) {
  auto* req = static_cast<S3Client::Request*>(user);
  const size_t want = std::min(size * n, req->body.size() - req->sent);
  std::memcpy(buf, req->body.data() + req->sent, want);
  req->sent += want;
  return want;
}

struct Sink {
  S3Client::Request* req;
  std::string* body;
  CURL* curl;
};

size_t write_body(char* data, size_t size, size_t n, void* user) {
  auto* sink = static_cast<Sink*>(user);
  const size_t bytes = size * n;
  long status = 0;
  curl_easy_getinfo(sink->curl, CURLINFO_RESPONSE_CODE, &status);
  S3Client::Request* req = sink->req;
  if (req->out_fd >= 0 && status >= 200 && status < 300) {
    for (size_t done = 0; done < bytes;) {
      const ssize_t w = ::write(req->out_fd, data + done, bytes - done);
      if (w < 0) {
        if (errno == EINTR) continue;
        req->write_error = std::strerror(errno);
        return 0;  // curl fails the transfer (CURLE_WRITE_ERROR)
      }
      done += static_cast<size_t>(w);
    }
    XXH3_64bits_update(req->hash, data, bytes);
    req->received += bytes;
  } else {
    sink->body->append(data, bytes);
  }
  return bytes;
}

size_t read_header(char* data, size_t size, size_t n, void* user) {
  auto* headers = static_cast<std::vector<std::pair<std::string, std::string>>*>(user);
  std::string line(data, size * n);
  const size_t colon = line.find(':');
  if (colon != std::string::npos) {
    std::string name = line.substr(0, colon), value = line.substr(colon + 1);
    std::transform(name.begin(), name.end(), name.begin(), [](unsigned char c) { return std::tolower(c); });
    const size_t b = value.find_first_not_of(" \t"), e = value.find_last_not_of(" \t\r\n");
    headers->push_back({name, b == std::string::npos ? "" : value.substr(b, e - b + 1)});
  }
  return size * n;
}

int progress(void* user, curl_off_t, curl_off_t, curl_off_t, curl_off_t) {
  const auto* cancel = static_cast<const std::atomic<bool>*>(user);
  return cancel != nullptr && cancel->load() ? 1 : 0;  // non-zero aborts the transfer
}

}  // namespace

S3Client::Response S3Client::attempt(Request& req) {
  CURL* c = static_cast<CURL*>(curl_);
  curl_easy_reset(c);  // keeps the connection: the next call reuses it
  Response res;
  // The canonical query string (SigV4): sorted by name, each name and value encoded;
  // libcurl signs the URL's query as it is given.
  std::sort(req.query.begin(), req.query.end());
  std::string query;
  for (const auto& [k, v] : req.query) {
    query += (query.empty() ? "" : "&") + uri_encode(k, false) + "=" + uri_encode(v, false);
  }
  const std::string url = opt_.endpoint + "/" + uri_encode(req.bucket, false) +
                          (req.key.empty() ? "" : "/" + uri_encode(req.key, true)) + (query.empty() ? "" : "?" + query);
  const std::string sigv4 = "aws:amz:" + opt_.region + ":s3";
  curl_easy_setopt(c, CURLOPT_URL, url.c_str());
  curl_easy_setopt(c, CURLOPT_AWS_SIGV4, sigv4.c_str());
  curl_easy_setopt(c, CURLOPT_USERNAME, opt_.access_key.c_str());
  curl_easy_setopt(c, CURLOPT_PASSWORD, opt_.secret_key.c_str());
  curl_easy_setopt(c, CURLOPT_NOSIGNAL, 1L);
  curl_easy_setopt(c, CURLOPT_CONNECTTIMEOUT_MS, static_cast<long>(opt_.connect_timeout_s * 1000));
  curl_easy_setopt(c, CURLOPT_LOW_SPEED_LIMIT, 1024L);
  curl_easy_setopt(c, CURLOPT_LOW_SPEED_TIME, static_cast<long>(opt_.low_speed_timeout_s));
  curl_easy_setopt(c, CURLOPT_NOPROGRESS, 0L);
  curl_easy_setopt(c, CURLOPT_XFERINFOFUNCTION, progress);
  curl_easy_setopt(c, CURLOPT_XFERINFODATA, const_cast<std::atomic<bool>*>(opt_.cancel));
  // The payload is not hashed (UNSIGNED-PAYLOAD: libcurl signs this header's value as the
  // payload hash). libcurl signs every header given here, so none is given that is not sent
  // (an "Expect:" that removes one would be signed and break the signature).
  curl_slist* headers = curl_slist_append(nullptr, "x-amz-content-sha256: UNSIGNED-PAYLOAD");
  if (!opt_.session_token.empty()) {
    headers = curl_slist_append(headers, ("x-amz-security-token: " + opt_.session_token).c_str());
  }
  for (const std::string& h : req.headers) headers = curl_slist_append(headers, h.c_str());
  curl_easy_setopt(c, CURLOPT_HTTPHEADER, headers);
  const std::string method = req.method;
  req.sent = 0;
  if (method == "HEAD") {
    curl_easy_setopt(c, CURLOPT_NOBODY, 1L);
  } else if (method == "PUT") {
    curl_easy_setopt(c, CURLOPT_UPLOAD, 1L);
    curl_easy_setopt(c, CURLOPT_READFUNCTION, read_body);
    curl_easy_setopt(c, CURLOPT_READDATA, &req);
    curl_easy_setopt(c, CURLOPT_INFILESIZE_LARGE, static_cast<curl_off_t>(req.body.size()));
  } else if (method == "POST") {
    curl_easy_setopt(c, CURLOPT_POST, 1L);
    curl_easy_setopt(c, CURLOPT_POSTFIELDS, req.body.data());
    curl_easy_setopt(c, CURLOPT_POSTFIELDSIZE_LARGE, static_cast<curl_off_t>(req.body.size()));
  } else if (method != "GET") {
    curl_easy_setopt(c, CURLOPT_CUSTOMREQUEST, req.method);
  }
  if (req.out_fd >= 0) {  // a retried download starts its file over
    MT_CHECK(::ftruncate(req.out_fd, 0) == 0 && ::lseek(req.out_fd, 0, SEEK_SET) == 0,
             "S3 GET {}: cannot truncate the local file: {}", S3Location{req.bucket, ""}.url(req.key),
             std::strerror(errno));
    XXH3_64bits_reset(req.hash);
    req.received = 0;
  }
  Sink sink{&req, &res.body, c};
  curl_easy_setopt(c, CURLOPT_WRITEFUNCTION, write_body);
  curl_easy_setopt(c, CURLOPT_WRITEDATA, &sink);
  curl_easy_setopt(c, CURLOPT_HEADERFUNCTION, read_header);
  curl_easy_setopt(c, CURLOPT_HEADERDATA, &res.headers);
  const CURLcode rc = curl_easy_perform(c);
  curl_slist_free_all(headers);
  if (rc != CURLE_OK) {
    const std::string why = !req.write_error.empty() ? "writing the local file: " + req.write_error
                            : rc == CURLE_ABORTED_BY_CALLBACK ? std::string("cancelled")
                                                              : std::string(curl_easy_strerror(rc));
    throw S3Error(fmt::format("S3 {} {}: no answer from {}: {}", method, S3Location{req.bucket, ""}.url(req.key),
                              opt_.endpoint, why),
                  0, rc == CURLE_ABORTED_BY_CALLBACK ? "Cancelled" : "");
  }
  curl_easy_getinfo(c, CURLINFO_RESPONSE_CODE, &res.status);
  return res;
}

S3Client::Response S3Client::call(Request& req, std::vector<long> also_ok) {
  const std::string what = fmt::format("S3 {} {}", req.method, S3Location{req.bucket, ""}.url(req.key));
  double wait = opt_.backoff_s;
  for (int attempt_no = 1;; ++attempt_no) {
    std::optional<S3Error> failure;
    try {
      // Fault injection (ft/fault.h): `error@s3` answers this try as an S3 server in
      // trouble would (503 SlowDown), without sending it.
      if (fault_point("s3", -1)) throw S3Error(what + ": HTTP 503 SlowDown (injected by MOETRAIN_FAULT)", 503, "SlowDown");
      Response res = attempt(req);
      if ((res.status >= 200 && res.status < 300) ||
          std::find(also_ok.begin(), also_ok.end(), res.status) != also_ok.end()) {
        return res;
      }
      const std::string code = xml_first(res.body, "Code"), message = xml_first(res.body, "Message");
      failure.emplace(fmt::format("{}: HTTP {}{}{}", what, res.status, code.empty() ? "" : " " + code,
                                  message.empty() ? "" : ": " + message),
                      static_cast<int>(res.status), code);
    } catch (S3Error& e) {
      failure.emplace(e);
    }
    const int status = failure->status();
    const bool cancelled = opt_.cancel != nullptr && opt_.cancel->load();
    const bool transient = status == 0 || status >= 500 || status == 429 || failure->code() == "RequestTimeout";
    if (!transient || cancelled || failure->code() == "Cancelled" || attempt_no >= opt_.max_attempts) {
      if (attempt_no > 1) {
        throw S3Error(fmt::format("{} (after {} tries)", failure->what(), attempt_no), status, failure->code());
      }
      throw *failure;
    }
    spdlog::debug("{}; retrying in {:.2f} s", failure->what(), wait);
    // The wait between tries, cut short by a cancel.
    const auto until = std::chrono::steady_clock::now() + std::chrono::duration<double>(wait);
    while (std::chrono::steady_clock::now() < until && !(opt_.cancel != nullptr && opt_.cancel->load())) {
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
    wait = std::min(wait * 2, opt_.max_backoff_s);
  }
}

void S3Client::create_bucket(const std::string& bucket) {
  Request req;
  req.method = "PUT";
  req.bucket = bucket;
  Response res = call(req, {409});
  MT_CHECK(res.status != 409 || xml_first(res.body, "Code") == "BucketAlreadyOwnedByYou",
           "S3 PUT s3://{}: HTTP 409 {}: {}", bucket, xml_first(res.body, "Code"), xml_first(res.body, "Message"));
}

void S3Client::put(const std::string& bucket, const std::string& key, std::string_view body) {
  Request req;
  req.method = "PUT";
  req.bucket = bucket;
  req.key = key;
  req.body = body;
  call(req);
}

uint64_t S3Client::put_file(const std::string& bucket, const std::string& key, const std::string& path) {
  const MappedFile file(path);
  const std::string_view all(file.data ? file.data : "", file.size);
  if (file.size <= static_cast<uint64_t>(opt_.part_size)) {
    put(bucket, key, all);
    return file.size;
  }
  // S3 takes at most 10,000 parts: a file larger than that many parts gets larger parts.
  const uint64_t part = std::max<uint64_t>(opt_.part_size, (file.size + 9999) / 10000);
  const std::string id = create_multipart(bucket, key);
  try {
    std::vector<std::string> etags;
    for (uint64_t at = 0; at < file.size; at += part) {
      etags.push_back(upload_part(bucket, key, id, static_cast<int>(etags.size()) + 1, all.substr(at, part)));
    }
    complete_multipart(bucket, key, id, etags);
  } catch (...) {
    try {
      abort_multipart(bucket, key, id);
    } catch (const std::exception& e) {
      spdlog::warn("{} (its parts stay until the bucket's lifecycle rules remove them)", e.what());
    }
    throw;
  }
  return file.size;
}

std::string S3Client::get(const std::string& bucket, const std::string& key) {
  Request req;
  req.bucket = bucket;
  req.key = key;
  return call(req).body;
}

std::pair<uint64_t, uint64_t> S3Client::get_file(const std::string& bucket, const std::string& key,
                                                  const std::string& path) {
  const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  MT_CHECK(fd >= 0, "{}: cannot create for the download of {}: {}", path, S3Location{bucket, ""}.url(key),
           std::strerror(errno));
  XXH3_state_t* hash = XXH3_createState();
  Request req;
  req.bucket = bucket;
  req.key = key;
  req.out_fd = fd;
  req.hash = hash;
  try {
    call(req);
    MT_CHECK(::fsync(fd) == 0, "{}: fsync failed: {}", path, std::strerror(errno));
  } catch (...) {
    ::close(fd);
    XXH3_freeState(hash);
    throw;
  }
  ::close(fd);
  const uint64_t sum = XXH3_64bits_digest(hash);
  XXH3_freeState(hash);
  return {req.received, sum};
}

std::optional<S3Client::Object> S3Client::head(const std::string& bucket, const std::string& key) {
  Request req;
  req.method = "HEAD";
  req.bucket = bucket;
  req.key = key;
  Response res = call(req, {404});
  if (res.status == 404) return std::nullopt;
  Object o;
  o.key = key;
  o.size = std::strtoull(res.header("content-length").c_str(), nullptr, 10);
  o.etag = res.header("etag");
  return o;
}

void S3Client::remove(const std::string& bucket, const std::string& key) {
  Request req;
  req.method = "DELETE";
  req.bucket = bucket;
  req.key = key;
  call(req, {404});
}

std::vector<S3Client::Object> S3Client::list(const std::string& bucket, const std::string& prefix) {
  std::vector<Object> out;
  std::string token;
  while (true) {
    Request req;
    req.bucket = bucket;
    req.query = {{"list-type", "2"}, {"prefix", prefix}};
    if (!token.empty()) req.query.push_back({"continuation-token", token});
    const Response res = call(req);
    for (const std::string& c : xml_all(res.body, "Contents")) {
      Object o;
      o.key = xml_first(c, "Key");
      o.size = std::strtoull(xml_first(c, "Size").c_str(), nullptr, 10);
      o.etag = xml_first(c, "ETag");
      out.push_back(std::move(o));
    }
    if (xml_first(res.body, "IsTruncated") != "true") break;
    token = xml_first(res.body, "NextContinuationToken");
    MT_CHECK(!token.empty(), "S3 list s3://{}/{}: a truncated answer without NextContinuationToken", bucket, prefix);
  }
  std::sort(out.begin(), out.end(), [](const Object& a, const Object& b) { return a.key < b.key; });
  return out;
}

std::string S3Client::create_multipart(const std::string& bucket, const std::string& key) {
  Request req;
  req.method = "POST";
  req.bucket = bucket;
  req.key = key;
  req.query = {{"uploads", ""}};
  const std::string id = xml_first(call(req).body, "UploadId");
  MT_CHECK(!id.empty(), "S3 POST {}?uploads: the answer holds no UploadId", S3Location{bucket, ""}.url(key));
  return id;
}

std::string S3Client::upload_part(const std::string& bucket, const std::string& key, const std::string& upload_id,
                                  int part, std::string_view bytes) {
  Request req;
  req.method = "PUT";
  req.bucket = bucket;
  req.key = key;
  req.query = {{"partNumber", std::to_string(part)}, {"uploadId", upload_id}};
  req.body = bytes;
  const std::string etag = call(req).header("etag");
  MT_CHECK(!etag.empty(), "S3 PUT {} part {}: the answer holds no ETag", S3Location{bucket, ""}.url(key), part);
  return etag;
}

void S3Client::complete_multipart(const std::string& bucket, const std::string& key, const std::string& upload_id,
                                  const std::vector<std::string>& etags) {
  std::string xml = "<CompleteMultipartUpload>";
  for (size_t i = 0; i < etags.size(); ++i) {
    xml += fmt::format("<Part><PartNumber>{}</PartNumber><ETag>{}</ETag></Part>", i + 1, xml_escape(etags[i]));
  }
  xml += "</CompleteMultipartUpload>";
  Request req;
  req.method = "POST";
  req.bucket = bucket;
  req.key = key;
  req.query = {{"uploadId", upload_id}};
  req.headers = {"Content-Type: application/xml"};
  req.body = xml;
  // S3 may answer 200 and put an error in the body when the completion fails late.
  const Response res = call(req);
  const std::string code = xml_first(res.body, "Code");
  if (!code.empty() && res.body.find("<Error>") != std::string::npos) {
    throw S3Error(fmt::format("S3 POST {}?uploadId: {}: {}", S3Location{bucket, ""}.url(key), code,
                              xml_first(res.body, "Message")),
                  static_cast<int>(res.status), code);
  }
}

void S3Client::abort_multipart(const std::string& bucket, const std::string& key, const std::string& upload_id) {
  Request req;
  req.method = "DELETE";
  req.bucket = bucket;
  req.key = key;
  req.query = {{"uploadId", upload_id}};
  call(req, {404});
}

}  // namespace moetrain
