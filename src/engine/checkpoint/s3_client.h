// S3Client: the few S3 calls the remote checkpoint tier needs (docs/checkpoints.md#the-remote-tier),
// over libcurl, which signs each request itself (AWS Signature V4: CURLOPT_AWS_SIGV4).
//
// Path-style addressing (`<endpoint>/<bucket>/<key>`), which every S3-compatible server
// (MinIO, Ceph, s3rver, ...) and AWS itself accept, and which a localhost endpoint needs.
// Payloads are sent as UNSIGNED-PAYLOAD (the bytes are not hashed twice: the tier checks
// them with its own XXH3 checksums).
//
// Every call retries with exponential backoff on what may pass (a connection error or time
// out, HTTP 5xx, 429) and throws S3Error at once on what will not (other 4xx). An error
// names the method, s3://bucket/key, the HTTP status and the S3 error code and message.
// One client is one connection (reused between calls): use it from one thread at a time.
#pragma once

#include <atomic>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "core/error.h"

namespace moetrain {

struct S3Options {
  std::string endpoint;  // "http://127.0.0.1:9000" (scheme, host, port; no path)
  std::string region = "us-east-1";
  std::string access_key, secret_key, session_token;
  int max_attempts = 5;            // tries of one request (1 = no retry)
  double backoff_s = 0.25;         // the wait after the first failed try, doubled after each
  double max_backoff_s = 4.0;
  double connect_timeout_s = 5.0;  // a server that does not answer counts as a failed try
  double low_speed_timeout_s = 60; // a transfer slower than 1 KB/s for this long fails the try
  int64_t part_size = int64_t{64} << 20;  // put_file: multipart above this size, parts of it
  // Set by another thread to abandon calls in flight and the waits between tries (the
  // call then throws); may be null.
  const std::atomic<bool>* cancel = nullptr;

  // endpoint: the argument when not empty, else $AWS_ENDPOINT_URL_S3, else $AWS_ENDPOINT_URL,
  // else AWS (https://s3.<region>.amazonaws.com); region from $AWS_REGION or
  // $AWS_DEFAULT_REGION; credentials from $AWS_ACCESS_KEY_ID, $AWS_SECRET_ACCESS_KEY and
  // $AWS_SESSION_TOKEN. An error names the variable that is missing.
  static S3Options from_env(const std::string& endpoint = "");
};

// An S3 answer other than success, or a request that never got one (status 0).
class S3Error : public Error {
 public:
  S3Error(std::string message, int status, std::string code)
      : Error(std::move(message), __FILE__, __LINE__), status_(status), code_(std::move(code)) {}
  int status() const { return status_; }        // HTTP status; 0: no answer (connection)
  const std::string& code() const { return code_; }  // S3 error code ("NoSuchKey"), or ""

 private:
  int status_;
  std::string code_;
};

// "s3://bucket/some/prefix" split; the prefix has no leading or trailing '/'.
struct S3Location {
  std::string bucket, prefix;
  static S3Location parse(const std::string& url);  // an error names the url and the expected form
  std::string url(const std::string& key = "") const;  // "s3://bucket/key"
};

class S3Client {
 public:
  explicit S3Client(S3Options options);
  ~S3Client();
  S3Client(const S3Client&) = delete;
  S3Client& operator=(const S3Client&) = delete;

  const S3Options& options() const { return opt_; }

  struct Object {
    std::string key;
    uint64_t size = 0;
    std::string etag;
  };

  void create_bucket(const std::string& bucket);  // an existing bucket of ours is no error
  void put(const std::string& bucket, const std::string& key, std::string_view body);
  // Uploads a local file: one PUT up to part_size, else a multipart upload in parts of
  // part_size (larger where the file would need more than S3's 10,000 parts; aborted when a
  // part fails for good, so no parts are left behind). Returns the bytes sent.
  uint64_t put_file(const std::string& bucket, const std::string& key, const std::string& path);
  std::string get(const std::string& bucket, const std::string& key);
  // Downloads into `path` (created or truncated); returns its size and XXH3-64 of the bytes.
  std::pair<uint64_t, uint64_t> get_file(const std::string& bucket, const std::string& key, const std::string& path);
  std::optional<Object> head(const std::string& bucket, const std::string& key);  // nullopt: no such key
  void remove(const std::string& bucket, const std::string& key);                 // no such key: no error
  // Every object whose key starts with prefix (ListObjectsV2, all pages), in key order.
  std::vector<Object> list(const std::string& bucket, const std::string& prefix);

  // The multipart calls put_file makes, for tests of them.
  std::string create_multipart(const std::string& bucket, const std::string& key);
  std::string upload_part(const std::string& bucket, const std::string& key, const std::string& upload_id, int part,
                          std::string_view bytes);  // returns the part's ETag
  void complete_multipart(const std::string& bucket, const std::string& key, const std::string& upload_id,
                          const std::vector<std::string>& etags);
  void abort_multipart(const std::string& bucket, const std::string& key, const std::string& upload_id);

 // What one call sends (internal: public for the transfer callbacks in the .cpp file).
  struct Request;

 private:
  struct Response {
    long status = 0;
    std::string body;
    std::vector<std::pair<std::string, std::string>> headers;  // names lower case
    std::string header(const std::string& name) const;
  };
  // Sends `req`, retrying as the header says; throws S3Error unless the status is 2xx or
  // one of `also_ok`.
  Response call(Request& req, std::vector<long> also_ok = {});
  Response attempt(Request& req);

  S3Options opt_;
  void* curl_ = nullptr;  // CURL*
};

}  // namespace moetrain
