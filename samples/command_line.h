// The samples' command-line checks, shared so that every bound reads the same way: numeric flags
// with a lower bound ("--batch must be a positive integer (got 0)", not CLI11's range with its
// 300-digit maximum) and output paths checked before any work (a --save into a missing folder
// fails at once, not after the whole run).
//
//   CLI::App app{"..."};
//   kiln::samples::CommandLine cli(app);
//   cli.at_least("--batch", batch, 1, "examples per step");
//   cli.positive("--lr", lr, "peak learning rate");
//   if (auto exit_code = cli.parse(argc, argv)) return *exit_code;
//   kiln::samples::check_writable("--save", {save_path, optimizer_path(save_path)});
#pragma once
#include <kiln/kiln.h>

#include <CLI/CLI.hpp>
#include <cmath>
#include <filesystem>
#include <fmt/format.h>
#include <fstream>
#include <functional>
#include <optional>
#include <string>
#include <type_traits>
#include <unistd.h>
#include <vector>

namespace kiln::samples {

// Wraps a CLI::App: adds bounded numeric options and checks their bounds after parsing.
class CommandLine {
 public:
  explicit CommandLine(CLI::App& app) : app_(app) {}

  // An integer flag that must be >= `min`: "a positive integer" (1), "a non-negative integer"
  // (0), "an integer of at least -1" otherwise.
  template <typename Int>
  CLI::Option* at_least(const std::string& name, Int& value, std::type_identity_t<Int> min, const std::string& help) {
    const std::string rule = min == 1   ? "a positive integer"
                             : min == 0 ? "a non-negative integer"
                                        : fmt::format("an integer of at least {}", min);
    const std::string shown = min == 1 ? "POSITIVE" : min == 0 ? "NON-NEGATIVE" : fmt::format("AT LEAST {}", min);
    CLI::Option* option = app_.add_option(name, value, help)->check(CLI::Validator(shown));  // --help shows it
    checks_.push_back([option, name, &value, min, rule]() -> std::string {
      if (option->count() == 0 || value >= min) return "";
      return fmt::format("{} must be {} (got {})", name, rule, value);
    });
    return option;
  }

  // A floating-point flag that must be finite and > 0 (NaN and inf fail too).
  CLI::Option* positive(const std::string& name, double& value, const std::string& help) {
    CLI::Option* option = app_.add_option(name, value, help)->check(CLI::Validator("POSITIVE"));
    checks_.push_back([option, name, &value]() -> std::string {
      if (option->count() == 0 || (value > 0 && std::isfinite(value))) return "";
      return fmt::format("{} must be a finite positive number (got {})", name, value);
    });
    return option;
  }

  // Parses argv and checks the bound of every flag given (the defaults are in bounds). Returns
  // the exit code when the program should stop now (--help: 0; a bad flag: the message on
  // stderr and a non-zero code), nothing otherwise.
  std::optional<int> parse(int argc, char** argv) {
    try {
      app_.parse(argc, argv);
    } catch (const CLI::ParseError& e) {
      return app_.exit(e);
    }
    for (const auto& check : checks_) {
      const std::string message = check();
      if (message.empty()) continue;
      fmt::print(stderr, "error: {}\nRun with --help for more information.\n", message);
      return 2;
    }
    return std::nullopt;
  }

 private:
  CLI::App& app_;
  std::vector<std::function<std::string()>> checks_;  // each: "" or what is wrong with its flag
};

// Throws kiln::Error unless every path (files a flag will write at the end of the run) can be
// written: its folder exists and takes a new file (probed by creating one and removing it; the
// files themselves are written through a temporary beside them and renamed), and the path is
// not a folder. Empty paths are skipped.
inline void check_writable(const std::string& flag, const std::vector<std::string>& paths) {
  namespace fs = std::filesystem;
  for (const std::string& path : paths) {
    if (path.empty()) continue;
    const fs::path file(path);
    const fs::path folder = file.has_parent_path() ? file.parent_path() : fs::path(".");
    std::error_code error;
    KILN_CHECK(fs::is_directory(folder, error), flag, "{}: the folder {} does not exist; create it first or pick another "
               "path", path, folder.string());
    KILN_CHECK(!fs::is_directory(file, error), flag, "{} is a folder; give a file name", path);
    const fs::path probe = folder / fmt::format(".{}.write-check.{}", file.filename().string(), ::getpid());
    const bool writable = std::ofstream(probe).good();
    fs::remove(probe, error);
    KILN_CHECK(writable, flag, "{}: cannot create files in {}; pick a folder you can write to", path,
               folder.string());
  }
}

}  // namespace kiln::samples
